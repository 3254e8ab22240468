"""`edgeinfer serve` against the real `openai` client: a server started by the tests (as a
subprocess of the real CLI, on a free port of 127.0.0.1) on an F16 copy of the default model."""

from __future__ import annotations

import collections
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package ships with
import pytest

import edgeinfer
from edgeinfer_server import ServerConfig, check_credentials, create_app, is_loopback
from greedy_compare import NEAR_TIE
from test_batch_engine import f16_path  # noqa: F401  (a session fixture shared with the engine tests)


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three colours.",
    "Explain what a CPU does in two sentences.",
    "Say hello in Spanish.",
    "What is 2 + 2?",
    "Name a famous painter.",
    "Give me a word that rhymes with cat.",
]
KEY = "test-key-123"
MODEL_FILE = "edgeinfer-test-model.gguf"  # the name a test server's model (the F16 copy or the shipped Q4_1) is linked under


class Server:
    """`edgeinfer serve` in a subprocess; the URL comes from its 'serving ... at URL' line."""

    def __init__(self, model: Path, home: Path, *args: str):
        env = dict(os.environ, EDGEINFER_HOME=str(home))
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        link = home / MODEL_FILE
        if not link.exists():
            link.symlink_to(model)
        model = link
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgeinfer", "serve", str(model), "--port", "0", *args],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = ""
        while not self.url:
            line = self.lines.get(timeout=180)
            if line is None:
                raise RuntimeError("the server exited before it was ready:\n" + "".join(self.log))
            if " at http://" in line:
                self.url = line.split(" at ", 1)[1].split()[0]

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def client(self, **kw) -> openai.OpenAI:
        import openai  # (here: the client takes a second to import, for every worker's collection)

        return openai.OpenAI(base_url=self.url, api_key=kw.pop("api_key", "unused"), max_retries=0, timeout=120, **kw)

    def metrics(self, headers: dict | None = None) -> str:
        return httpx.get(self.url.removesuffix("/v1") + "/metrics", headers=headers, timeout=30).text

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(f16_path, tmp_path_factory) -> Iterator[Server]:  # noqa: F811
    s = Server(f16_path, tmp_path_factory.mktemp("serve-home"), "--parallel", "4", "--ctx", "8192",
               "--max-tokens-limit", "1024", "-kvu")  # one KV cache here; a stream per slot elsewhere
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def one_slot(f16_path, tmp_path_factory) -> Iterator[Server]:  # noqa: F811
    """One slot, so a request can start only when the one before has freed it; an API key."""
    s = Server(f16_path, tmp_path_factory.mktemp("serve-home-1"), "--parallel", "1", "--ctx", "2048",
               "--api-key", KEY, "--grace", "1")
    yield s
    s.stop()


def chat(client, content: str, **kw):
    """A chat request for the one model a test server serves (its file name)."""
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 32)
    kw.setdefault("model", MODEL_FILE)
    return client.chat.completions.create(messages=[{"role": "user", "content": content}], **kw)


@pytest.fixture(scope="module")
def model_id(server) -> str:
    return server.client().models.list().data[0].id


# -- the fast tier: configuration and the credential check -----------------------------------------


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("example.org")


def test_api_key_required_off_localhost():
    with pytest.raises(edgeinfer.InvalidOptionError, match="api-key"):
        ServerConfig(host="0.0.0.0").validate()
    ServerConfig(host="0.0.0.0", api_key="k").validate()
    ServerConfig(host="127.0.0.1").validate()


def test_credentials_check():
    open_config = ServerConfig()
    locked = ServerConfig(host="0.0.0.0", api_key="s3cret")
    assert check_credentials(open_config, None)
    assert not check_credentials(locked, None)
    assert not check_credentials(locked, "Bearer wrong")
    assert not check_credentials(locked, "Basic s3cret")
    assert check_credentials(locked, "Bearer s3cret")
    assert check_credentials(locked, "bearer s3cret")


def test_cli_refuses_a_public_address_without_a_key(capsys):
    from edgeinfer.cli import main

    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 1
    assert "api-key" in capsys.readouterr().err


# -- the real server ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_app_enforces_the_key_for_a_public_host(f16_path):  # noqa: F811
    """The app built for a non-loopback host (not bound: tested in-process) refuses requests
    without the right Bearer key and serves them with it."""
    from starlette.testclient import TestClient

    engine = edgeinfer.BatchEngine.load(f16_path, batch=edgeinfer.BatchOptions(parallel=1), n_ctx=1024)
    try:
        app = create_app(engine, ServerConfig(host="0.0.0.0", api_key="s3cret"))
        with TestClient(app, base_url="http://127.0.0.1") as http:  # (TestClient's "testserver" is no allowed Host)
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
            assert http.get("/v1/models").status_code == 401
            assert http.get("/metrics").status_code == 401
            assert http.get("/health").status_code == 200
            ok = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"
    finally:
        engine.close()


@pytest.mark.slow
def test_models_health_metrics(server, model_id):
    assert model_id.endswith(".gguf") or ":" in model_id
    base = server.url.removesuffix("/v1")
    health = httpx.get(base + "/health").json()
    assert health["status"] == "ok" and health["slots"] == 4
    assert any("4 slots of 2048 tokens, one KV cache" in line for line in server.log), server.log  # -kvu
    text = server.metrics()
    for name in ("edgeinfer_requests_submitted_total", "edgeinfer_queue_depth", "edgeinfer_slot_decode_tokens_per_second",
                 "edgeinfer_speculation_acceptance_ratio", "edgeinfer_http_requests_total"):
        assert f"# TYPE {name}" in text


@pytest.mark.slow
def test_chat_streaming_equals_non_streaming_with_usage(server, model_id):
    client = server.client()
    whole = chat(client, PROMPTS[0], model=model_id)
    assert whole.object == "chat.completion" and whole.model == model_id
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens > 0 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    stats = whole.model_extra["edgeinfer"]
    assert stats["generated_tokens"] == whole.usage.completion_tokens

    stream = chat(client, PROMPTS[0], model=model_id, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.slow
def test_completions_streaming_and_not(server, model_id):
    client = server.client()
    whole = client.completions.create(model=model_id, prompt="The three primary colours are", max_tokens=20,
                                      temperature=0.0)
    assert whole.object == "text_completion" and whole.choices[0].text
    parts = list(client.completions.create(model=model_id, prompt="The three primary colours are", max_tokens=20,
                                           temperature=0.0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    tokens = client.completions.create(model=model_id, prompt=[1, 504, 2789], max_tokens=3, temperature=0.0)
    assert tokens.usage.prompt_tokens == 3


@pytest.mark.slow
def test_stop_strings(server, model_id):
    client = server.client()
    free = chat(client, PROMPTS[3], max_tokens=60).choices[0].message.content
    words = free.split()
    assert len(words) > 4
    stop = words[3]
    cut = chat(client, PROMPTS[3], max_tokens=60, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == free[: free.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, PROMPTS[3], max_tokens=60, stop=stop,
                                                                       stream=True) if c.choices)
    assert streamed == cut.choices[0].message.content


@pytest.mark.slow
def test_seed_reproducibility(server):
    client = server.client()
    a = chat(client, PROMPTS[1], temperature=1.0, seed=1234, max_tokens=40).choices[0].message.content
    b = chat(client, PROMPTS[1], temperature=1.0, seed=1234, max_tokens=40).choices[0].message.content
    assert a == b


@pytest.mark.slow
def test_logprobs(server):
    r = chat(server.client(), PROMPTS[5], max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top one
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


@pytest.mark.slow
def test_eight_concurrent_clients_match_lone_requests(server):
    """Each of 8 concurrent greedy requests (4 slots: batched and queued) gets the answer it gets
    alone, except at a near-tie (reported with its margin); /metrics, polled all the while,
    answers every time."""
    client = server.client()
    kw = {"max_tokens": 20, "logprobs": True, "top_logprobs": 2}  # 160 tokens compared
    alone = [chat(client, p, **kw) for p in PROMPTS]

    results: dict[int, object] = {}
    barrier = threading.Barrier(len(PROMPTS))

    def one(i: int) -> None:
        barrier.wait()
        results[i] = chat(server.client(), PROMPTS[i], **kw)

    statuses: list[int] = []
    done = threading.Event()

    def poll_metrics() -> None:
        with httpx.Client(timeout=30) as http:
            while not done.is_set():
                statuses.append(http.get(server.url.removesuffix("/v1") + "/metrics").status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    poller = threading.Thread(target=poll_metrics)
    poller.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    poller.join(60)
    assert statuses and set(statuses) == {200}, collections.Counter(statuses)
    assert sorted(results) == list(range(len(PROMPTS)))
    for i, lone in enumerate(alone):
        a = [e.token for e in lone.choices[0].logprobs.content]
        b = [e.token for e in results[i].choices[0].logprobs.content]
        if a == b:
            continue
        j = next(k for k in range(min(len(a), len(b)) + 1) if k == min(len(a), len(b)) or a[k] != b[k])
        assert j < min(len(a), len(b)), f"request {i}: one output stops where the other goes on"
        top = lone.choices[0].logprobs.content[j].top_logprobs
        margin = top[0].logprob - top[1].logprob  # = the logit margin: both share one normaliser
        print(f"request {i} parts from its lone answer at token {j}: top-2 margin {margin:.4f}")
        assert margin < NEAR_TIE
    assert "edgeinfer_queue_depth{" in server.metrics()


@pytest.mark.slow
def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(server, model_id):
    url = server.url + "/chat/completions"
    ok = {"model": model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    def post(body, status: int, **kw) -> dict:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        r = httpx.post(url, content=content, headers={"Content-Type": "application/json"}, timeout=60, **kw)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"] and err["type"]
        return err

    assert post(b"{not json", 400)["code"] == "invalid_json"
    post(b"[1, 2]", 400)
    post({"messages": []}, 400)
    post({"messages": [{"content": "no role"}]}, 400)
    assert post({**ok, "model": "no-such-model"}, 404)["code"] == "model_not_found"
    assert post({**ok, "messages": [{"role": "user", "content": "word " * 3000}]}, 400)["code"] == "context_length_exceeded"
    assert post({**ok, "max_tokens": 10**6}, 400)["param"] == "max_tokens"
    post({**ok, "temperature": "hot"}, 400)
    post({**ok, "n": 2}, 400)
    assert post({**ok, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"oneOf": []}}}},
                400)["param"] == "response_format"
    assert post({**ok, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, 400)["param"] == "tools"
    post({**ok, "speculation": "draft"}, 400)
    assert post(b"{" + b" " * (2 << 20) + b"}", 413)["code"] == "request_too_large"
    r = httpx.get(server.url + "/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    # ... and it still answers.
    assert chat(server.client(), "Hi", max_tokens=3).choices[0].message.role == "assistant"
    import openai

    with pytest.raises(openai.NotFoundError):
        chat(server.client(), "Hi", model="no-such-model")


@pytest.mark.slow
def test_speculation_per_request(server):
    client = server.client()
    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    prompt = f"Repeat this code exactly:\n\n{text}"
    plain = chat(client, prompt, max_tokens=60)
    # A fixed draft length drafts wherever lookup finds a match, whatever this machine's costs say.
    fixed = {"method": "lookup", "adaptive": False, "draft_max": 4}
    for extra in ("lookup", fixed):
        fast = chat(client, prompt, max_tokens=60, extra_body={"speculation": extra})
        spec = fast.model_extra["edgeinfer"]["speculation"]
        assert spec["method"] == "lookup"
        assert fast.choices[0].message.content == plain.choices[0].message.content
    assert spec["drafted"] > 0 and spec["accepted"] > 0, spec
    off = chat(client, prompt, max_tokens=8, extra_body={"speculation": "off"})
    assert "speculation" not in off.model_extra["edgeinfer"]


@pytest.mark.slow
def test_a_request_cannot_name_a_draft_model(server):
    """The draft model is the server's --speculate: a request naming a file on the server's disk,
    or a method the server did not open, is a 400 that says so."""
    import openai

    client = server.client()
    for extra, words in (({"method": "draft", "draft_model": "/etc/passwd"}, "may set"),
                         ("draft", "did not open"), ("medusa", "did not open"), ({"self_quant": "Q2_K"}, "may set"),
                         ("nonsense", "must be")):
        with pytest.raises(openai.BadRequestError, match=words):
            chat(client, "Hi", max_tokens=2, extra_body={"speculation": extra})


# -- one slot: disconnects and Ctrl-C ------------------------------------------------------------------


@pytest.mark.slow
def test_the_key_is_enforced_by_the_running_server(one_slot):
    import openai

    with pytest.raises(openai.AuthenticationError):
        chat(one_slot.client(api_key="wrong"), "Hi", max_tokens=2)
    assert chat(one_slot.client(api_key=KEY), "Hi", max_tokens=2).choices[0].message.content is not None


@pytest.mark.slow
def test_disconnect_mid_stream_frees_the_slot(one_slot):
    """With one slot, the next request can start only once the first has let go of it: the
    first must end as cancelled (not finish its 2000 tokens) as soon as its client is gone."""
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": [{"role": "user", "content": "Tell me a very long story about dragons."}],
            "max_tokens": 2000, "temperature": 0.8, "seed": 5, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", one_slot.url + "/chat/completions", json=body, headers=auth) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
        # the connection is closed here, mid-stream
    nxt = chat(one_slot.client(api_key=KEY), "Say hi.", max_tokens=4)
    assert nxt.choices[0].finish_reason in ("stop", "length")
    assert re.search(r'reason="cancelled"\} 1$', one_slot.metrics(auth), re.MULTILINE)


@pytest.mark.slow
def test_ctrl_c_ends_running_streams_cleanly(f16_path, tmp_path):  # noqa: F811
    s = Server(f16_path, tmp_path / "home", "--parallel", "1", "--ctx", "2048", "--grace", "1")
    client = s.client()
    stream = chat(client, "Tell me a very long story about dragons.", max_tokens=2000, temperature=0.8, seed=9,
                  stream=True)
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    s.proc.send_signal(signal.SIGINT)
    rest = list(chunks)
    finishes = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    # 2000 tokens of a story take minutes here: the 1 s grace ends it, as cancelled.
    assert finishes == ["cancelled"], finishes
    assert s.proc.wait(timeout=60) == 0
