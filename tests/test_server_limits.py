"""One request cannot kill or freeze `edgeinfer serve` (issue 45, all but grammars): durations too
long for Python's waits, embeddings and tokenizing off the event loop in bounded pools, names and
parameters in errors, and JSON that never carries NaN. Each case goes through the real CLI server
in a subprocess (tests/test_server.py's Server) on the shipped default model, with every new
flag at a non-default value; each failed before its fix (the issue's probe)."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import pytest

from edgeinfer.service import MAX_DURATION
from test_server import MODEL_FILE, Server
from test_server_security import assert_no_traceback
from test_service import wait_until

pytestmark = pytest.mark.slow

CHAT = {"model": MODEL_FILE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0.0}
MAX_QUEUE = 4  # --max-queue (default 32)
MAX_EMBED_TOKENS = 8192  # --max-embed-tokens (default 32768)
# /health must answer within 100 ms under any single request: the tests hold the median of its
# answers to that, and allow any one answer 10 s. These 2 cores are shared (a load average above 10
# while the suite and other work run is common here), and there an idle server's /health was
# measured at a 20 ms median but up to 2.6 s at worst (its first minutes calibrate on both cores);
# what the tests catch stalled /health for the whole of a long call: tens of seconds, or minutes.
HEALTH_MEDIAN = 0.1
HEALTH_STALL = 10.0


def token_ids(n: int, salt: int = 0) -> list[int]:
    """n ordinary token ids of the default model's vocabulary (49,152; specials are the first few)."""
    return [1000 + (salt * 7919 + i * 31) % 40000 for i in range(n)]


def embedding(n_inputs: int, n_tokens: int) -> dict:
    return {"model": MODEL_FILE, "input": [token_ids(n_tokens, k) for k in range(n_inputs)], "pooling": "mean"}


class HealthProbe:
    """GET /health every PAUSE seconds from a thread, keeping each answer's latency (seconds). (Not
    back to back: a probe that never pauses takes a core from the server it is probing.)"""

    PAUSE = 0.05

    def __init__(self, server: Server):
        self.latencies: list[float] = []
        self.statuses: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(server,), daemon=True)
        self._thread.start()

    def _run(self, server: Server) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                self.statuses.add(client.get(base(server) + "/health").status_code)
                self.latencies.append(time.monotonic() - started)
                self._stop.wait(self.PAUSE)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


class LongCall:
    """A POST whose client can leave while it runs: the socket is shut down (a FIN the server sees
    at once), not only closed (a close from another thread leaves the blocked read holding the
    connection open until the answer comes, so the server would never see the client go)."""

    def __init__(self, server: Server, body: dict):
        url = httpx.URL(base(server))
        self._conn = http.client.HTTPConnection(url.host, url.port, timeout=600)
        self._conn.connect()
        self._body = json.dumps(body)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._conn.request("POST", "/v1/embeddings", self._body, {"Content-Type": "application/json"})
            self._conn.getresponse().read()
        except OSError:  # http.client's errors are OSErrors too: the test shut the socket
            pass
        finally:
            self._done.set()

    def running(self) -> bool:
        return not self._done.is_set()

    def leave(self) -> None:
        sock = self._conn.sock
        if sock is not None and self.running():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=60)
        self._conn.close()


def leases(server: Server) -> int:
    """Requests holding the default model now (running, queued, or embedding)."""
    return sum(m["requests"] for m in get(server, "/edgeinfer/ps").json()["models"])


def base(server: Server) -> str:
    return server.url.removesuffix("/v1")


def post(server: Server, path: str, body: object, **kw) -> httpx.Response:
    return httpx.post(base(server) + path, json=body, timeout=kw.pop("timeout", 120), **kw)


def get(server: Server, path: str, **kw) -> httpx.Response:
    return httpx.get(base(server) + path, timeout=kw.pop("timeout", 60), **kw)


@pytest.fixture(scope="module")
def server(q4_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("serve-limits")
    s = Server(q4_path, home, "--parallel", "2", "--ctx", "2048",
               "--keep-alive", "1e10", "--max-queue", str(MAX_QUEUE), "--max-embed-tokens", str(MAX_EMBED_TOKENS),
               "--work-timeout", "600", "--slot-save-path", str(home / "saved-slots"), "--slot-quota", "100K")
    yield s
    assert s.stop() == 0
    assert_no_traceback(s)


def test_a_keep_alive_too_long_for_python_then_zero_unloads_and_the_model_comes_back(server):
    """`--keep-alive 1e10` and a request's `"keep_alive": "1e10"` (OpenAI's extension field, and
    Ollama's) used to kill the janitor thread (OverflowError: Python cannot wait ~9.2e9 s); a
    `"keep_alive": 0` after it then left the model "unloading" for good, every request for it
    waiting 60 s for a 503 while /health said ok. Clamped to a year, the model unloads at once and
    the next request loads it again."""
    assert get(server, "/edgeinfer/ps").json()["keep_alive"] == MAX_DURATION
    assert post(server, "/v1/chat/completions", {**CHAT, "keep_alive": "1e10"}).status_code == 200
    r = post(server, "/api/generate", {"model": MODEL_FILE, "prompt": "Hi", "stream": False, "keep_alive": 1e10,
                                       "options": {"num_predict": 2}})
    assert r.status_code == 200, r.text
    (model,) = get(server, "/edgeinfer/ps").json()["models"]
    assert model["keep_alive"] == MAX_DURATION and MAX_DURATION - 600 < model["expires_in_s"] <= MAX_DURATION
    assert post(server, "/v1/chat/completions", {**CHAT, "keep_alive": 0}).status_code == 200
    wait_until(lambda: not get(server, "/edgeinfer/ps").json()["models"], 60, "the keep_alive 0 unload")
    assert get(server, "/health").json()["status"] == "ok"
    assert post(server, "/v1/chat/completions", CHAT).status_code == 200  # loaded again (not a 503 after 60 s)
    assert_no_traceback(server)


# -- no long work on the event loop, nor in the threads the other routes use ---------------------------


def test_health_and_chat_answer_while_one_embedding_and_45_more_fill_the_queue(server):
    """The issue's case: one call with 6 x 1,024 token ids and 45 small ones at once used to block
    /health and chat for ~50 s (every worker thread waiting on the one embedder, --max-queue not
    counting them). Now /health answers within HEALTH_MEDIAN (its median; any one answer within
    HEALTH_STALL) throughout, a chat request is answered
    while the long call still runs, and --max-queue turns the small calls beyond its places away
    with 503 queue_full (one running + MAX_QUEUE waiting per model)."""
    probe = HealthProbe(server)
    long_call = LongCall(server, embedding(6, 1024))
    try:
        wait_until(lambda: leases(server) >= 1, 60, "the long embedding to hold the model")
        small = {"model": MODEL_FILE, "input": "hello", "pooling": "mean"}
        with ThreadPoolExecutor(45) as pool:
            smalls = [pool.submit(post, server, "/v1/embeddings", small, timeout=600) for _ in range(45)]
            answer = post(server, "/v1/chat/completions", CHAT)
            assert answer.status_code == 200 and long_call.running(), answer.text  # while the long call runs
            wait_until(lambda: len(probe.latencies) >= 20, 60, "20 /health answers")
            assert long_call.running()  # ... all while the long call runs (it used to get them only once it ended)
            long_call.leave()  # the long call's client leaves: it stops at its next decode, and the rest run
            statuses = [f.result().status_code for f in smalls]
            refused = [f.result() for f in smalls if f.result().status_code == 503]
    finally:
        long_call.leave()
        probe.stop()
    # the server saw the client go and stopped the call (499, nginx's "client closed request")
    wait_until(lambda: 'endpoint="embeddings",status="499"' in server.metrics(), 60, "the long call's 499")
    latencies = sorted(probe.latencies)
    assert latencies[len(latencies) // 2] < HEALTH_MEDIAN and latencies[-1] < HEALTH_STALL, latencies
    assert probe.statuses == {200}
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 1, statuses
    assert len(refused) >= 45 - MAX_QUEUE - 1, statuses
    assert all(r.json()["error"]["code"] == "queue_full" and r.headers["Retry-After"] == "1" for r in refused)
    assert_no_traceback(server)


def test_a_long_embedding_gives_its_memory_back(server):
    """A 1,024-token input grows the embedding context to 1,024 tokens: llama.cpp's compute buffer
    for it (the output layer's n_vocab x 1,024 floats, 202 MiB on this model) and its KV cache
    (22.5 MiB) used to stay for the server's life (~230 MB that `edgeinfer ps` does not count).
    Now the grown context is freed when the call ends; the 512-token one stays for the next call."""
    assert post(server, "/v1/embeddings", {"model": MODEL_FILE, "input": "warm", "pooling": "mean"}).status_code == 200
    before = get(server, "/edgeinfer/ps").json()["process"]["anon"]
    r = post(server, "/v1/embeddings", embedding(1, 1024), timeout=600)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1024
    after = get(server, "/edgeinfer/ps").json()["process"]["anon"]
    assert after - before < 80e6, (before, after)  # (the context alone is ~230 MB)


def test_embedding_work_is_bounded_before_it_runs(server):
    """A 2,048-input call used to run for more than 300 s. One call embeds at most
    --max-embed-tokens tokens, all inputs together: more is a 400 naming the flag, at once, on both
    routes; 2,048 short inputs within it are embedded."""
    many = {"model": MODEL_FILE, "input": ["one two three four five six seven"] * 2048, "pooling": "mean"}
    r = post(server, "/v1/embeddings", many)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert "--max-embed-tokens" in r.json()["error"]["message"] and str(MAX_EMBED_TOKENS) in r.json()["error"]["message"]
    r = post(server, "/v1/embeddings", {**many, "input": [token_ids(5, k) for k in range(2048)]})
    assert r.status_code == 400 and "--max-embed-tokens" in r.json()["error"]["message"]
    r = post(server, "/v1/embeddings", {**many, "input": ["a"] * 2048}, timeout=600)
    assert r.status_code == 200 and len(r.json()["data"]) == 2048, r.text[:300]
    assert r.json()["usage"]["prompt_tokens"] <= MAX_EMBED_TOKENS


@pytest.fixture
def impatient(q4_path, tmp_path):
    """--work-timeout 2 (default 60); its slot folder and quota from serve.toml's [slots]."""
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "serve.toml").write_text('[slots]\npath = "slot-files"\nquota = "64M"\n')
    s = Server(q4_path, tmp_path / "home", "--parallel", "1", "--ctx", "1024", "--work-timeout", "2")
    yield s
    assert s.stop() == 0
    assert_no_traceback(s)


def test_work_past_its_timeout_is_a_503_and_stops(impatient):
    """An embeddings call that takes longer than --work-timeout from its arrival is answered 503
    (code "timeout", Retry-After) at that time, and stops at its next decode: the next call runs."""
    started = time.monotonic()
    r = post(impatient, "/v1/embeddings", embedding(32, 1024), timeout=600)
    assert r.status_code == 503 and r.json()["error"]["code"] == "timeout" and r.headers["Retry-After"] == "1", r.text
    assert "--work-timeout" in r.json()["error"]["message"]
    answered = time.monotonic()
    assert answered - started < 60  # answered at the timeout, not when 32 decodes of 1,024 tokens are done
    # The call stops at its next decode; until then a small call waits for the embedder and may
    # time out too (2 s on a loaded machine). Within 60 s it is served: the 32 decodes take minutes here.
    small = {"model": MODEL_FILE, "input": "hi", "pooling": "mean"}
    wait_until(lambda: post(impatient, "/v1/embeddings", small, timeout=600).status_code == 200, 60,
               "a small call after the one that timed out")


def test_sigterm_during_a_long_embedding_exits_within_the_grace(q4_path, tmp_path):
    """SIGTERM while an embeddings call of 32 x 1,024 tokens runs used to wait for all of it (the
    call held the embedder's lock that closing the model waits for, in a worker thread the
    interpreter joins at exit). Now the call stops at its next decode after --grace, and the
    process exits within --grace + 10 s (the CLI's deadline, whatever is stuck)."""
    from edgeinfer.cli.serve import SHUTDOWN_MARGIN

    grace = 1.0
    s = Server(q4_path, tmp_path / "home", "--parallel", "2", "--ctx", "2048", "--grace", str(grace))
    outcome: list[object] = []

    def long_call() -> None:
        try:
            outcome.append(post(s, "/v1/embeddings", embedding(32, 1024), timeout=900).status_code)
        except httpx.HTTPError as e:
            outcome.append(type(e).__name__)

    caller = threading.Thread(target=long_call, daemon=True)
    try:
        caller.start()
        wait_until(lambda: leases(s) >= 1, 60, "the long embedding to hold the model")
        signalled = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        # (the 5 s beyond the deadline: the process's own exit, on a machine shared with other work)
        s.proc.wait(timeout=grace + SHUTDOWN_MARGIN + 5)
        took = time.monotonic() - signalled
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    caller.join(timeout=60)
    assert took < grace + SHUTDOWN_MARGIN + 5 and s.proc.returncode in (0, 1), (took, s.proc.returncode)
    assert outcome and outcome[0] != 200, outcome
    log = "".join(s.log)
    assert "server stopped" in log or "exiting now" in log, log


# -- errors that are 4xx and say the right thing ------------------------------------------------------


def test_errors_cut_long_names_refuse_a_trailing_newline_and_name_the_prompt(server):
    """A 10 kB `model` name used to be echoed back whole; a name with a trailing newline passed the
    name check ($ matches before a final newline); the completions route's overflow error named
    `messages`. Now each is a 4xx whose message shows at most the first 80 characters of the name,
    "name\\n" is an invalid name, and the overflow names `prompt` (chat keeps `messages`)."""
    long = "m" * 10_000
    for path, body in (("/v1/chat/completions", {**CHAT, "model": long}),
                       ("/v1/embeddings", {"model": long, "input": "hi"}),
                       ("/api/generate", {"model": long, "prompt": "Hi", "stream": False}),
                       ("/edgeinfer/stop", {"model": long})):
        r = post(server, path, body)
        assert 400 <= r.status_code < 500 and len(r.content) < 1000 and "10000 characters" in r.text, (path, r.text[:300])
    r = post(server, "/v1/chat/completions", {**CHAT, "model": "smollm2\n"})
    assert r.status_code == 404 and "invalid model name" in r.json()["error"]["message"], r.text
    many = "one two three four five six seven eight nine ten " * 300  # ~3,000 tokens, 1,024 per request
    r = post(server, "/v1/completions", {"model": MODEL_FILE, "prompt": many, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = post(server, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": many}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert_no_traceback(server)


# -- slot files: a folder the operator gives, a quota ---------------------------------------------------


def test_the_slot_folder_and_quota_come_from_the_flags(server):
    """--slot-save-path DIR --slot-quota 100K: a slot's state (some 20 kB a token on this model)
    could pass the quota, so the save is a 507 naming the flag and the folder stays empty."""
    assert post(server, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "Hello there"}]},
                ).status_code == 200
    folder = server.home / "saved-slots"
    answers = [post(server, f"/slots/{slot}?action=save", {"filename": f"s{slot}.bin"}) for slot in (0, 1)]
    refused = [r for r in answers if r.status_code == 507]
    assert refused and all("--slot-quota" in r.json()["error"]["message"] for r in refused), [r.text for r in answers]
    # (the other slot may be empty: its state, tokens none, fits)
    assert all(r.status_code == 507 or r.json()["n_saved"] == 0 for r in answers), [r.text for r in answers]
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 100 << 10


def test_the_slot_folder_and_quota_come_from_serve_toml(impatient):
    """serve.toml's [slots] path (relative to the file) and quota turn the actions on without a flag."""
    assert post(impatient, "/v1/chat/completions", CHAT).status_code == 200
    r = post(impatient, "/slots/0?action=save", {"filename": "from-toml.bin"})
    assert r.status_code == 200 and r.json()["n_saved"] > 0, r.text
    assert (impatient.home / "slot-files" / "from-toml.bin").is_file()
    assert post(impatient, "/slots/0?action=restore", {"filename": "from-toml.bin"}).status_code == 200
