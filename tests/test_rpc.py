"""llama.cpp's RPC backend end to end: `edgeinfer rpc-worker` processes on localhost (ports chosen
here) hold parts of a model loaded with --rpc, and what goes wrong is one line, never a hang.

Every test skips, naming the rebuild command, where this llama-cpp-python was built without RPC
(a wheel pip had cached from a build without CMAKE_ARGS="-DGGML_RPC=ON").
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from greedy_compare import assert_same_or_near_tie

pytestmark = pytest.mark.slow

EDGEINFER = [sys.executable, "-m", "edgeinfer"]
PROMPT = "Explain in three sentences why the sky is blue."


@pytest.fixture(scope="module", autouse=True)
def _needs_rpc() -> None:
    from edgeinfer import devices

    if not devices.has_rpc():
        pytest.skip(f"this llama-cpp-python has no RPC backend; rebuild it with: {devices.rebuild_command()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """An `edgeinfer rpc-worker` subprocess; `line` is what it printed once it answered its own probe."""

    def __init__(self, *extra: str, port: int | None = None):
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        env = dict(os.environ, EDGEINFER_THREADS="1")
        self.proc = subprocess.Popen([*EDGEINFER, "rpc-worker", "--port", str(self.port), "--threads", "1", *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        self.line = self._read_line(60)

    def _read_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.stop()
            pytest.fail(f"rpc-worker on port {self.port} did not start within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            pytest.fail(f"rpc-worker on port {self.port} exited: {err[-2000:]}")
        return line.strip()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[Worker, Worker]]:
    a, b = Worker(), Worker("--mem", "1.5")
    yield a, b
    a.stop()
    b.stop()


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, EDGEINFER_THREADS="1")
    return subprocess.run([*EDGEINFER, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL, check=False)


def one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("edgeinfer: error: "), r.stderr
    assert "Traceback" not in r.stderr and "GGML" not in r.stderr
    return lines[0]


# -- the worker itself -----------------------------------------------------------------------------------


def test_worker_prints_protocol_and_reports_capped_memory(workers):
    from edgeinfer.devices import RPC_PROTOCOL, probe_worker

    a, b = workers
    version = "v{}.{}.{}".format(*RPC_PROTOCOL)
    for w in workers:
        assert w.line.startswith(f"edgeinfer rpc-worker: listening on {w.endpoint}, llama.cpp RPC protocol {version}"), w.line
        assert "1 threads" in w.line
    info = probe_worker(b.endpoint)
    assert info.protocol == RPC_PROTOCOL  # our constant is what this build's server speaks
    assert info.memory == ((int(1.5 * (1 << 30)), int(1.5 * (1 << 30))),)  # --mem 1.5
    assert probe_worker(a.endpoint).memory[0][1] > info.memory[0][1]


def test_worker_refuses_a_non_loopback_host_without_the_flag():
    r = cli("rpc-worker", "--host", "0.0.0.0", "--port", str(free_port()))
    assert "refusing to listen on 0.0.0.0" in one_error_line(r) and "--i-know-this-is-unauthenticated" in r.stderr
    r = cli("rpc-worker", "--host", "example.org")
    assert "must be an IPv4 address" in one_error_line(r)
    # With the flag the host passes; a port that is taken then stops it before it listens anywhere.
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = cli("rpc-worker", "--host", "0.0.0.0", "--i-know-this-is-unauthenticated", "--port", str(port))
    assert f"port {port} on 0.0.0.0 is in use" in one_error_line(r)


def test_worker_cache_dir(tmp_path):
    cache = tmp_path / "rpc-cache"
    w = Worker("--cache", str(cache))
    try:
        assert f"cache {cache}" in w.line and cache.is_dir()
    finally:
        w.stop()


# -- a model split over the workers --------------------------------------------------------------------


def _greedy(engine, n: int = 48) -> tuple[list[int], list[int]]:
    import edgeinfer

    prompt = engine.tokenize(PROMPT, add_special=True)
    done = engine.generate(prompt, edgeinfer.GenerateOptions(max_tokens=n, sampling=edgeinfer.SamplingOptions(
        temperature=0.0))).result()
    return list(prompt), list(done.tokens)


@pytest.fixture(scope="module")
def local_greedy(default_model_path):
    import edgeinfer

    with edgeinfer.load(default_model_path, n_threads=1) as engine:
        return _greedy(engine)


@pytest.mark.parametrize("split, expect", [
    ((1.0, 1.0, 1.0), [10, 11, 10]),  # llama.cpp: layers 0-9 here, 10-20 on the first worker, 21-30 (+output) on the second
    ((1.0, 0.0, 0.0), [31, 0, 0]),
    ((0.0, 1.0, 0.0), [0, 31, 0]),
])
def test_split_three_ways_gives_the_local_greedy_output(workers, default_model_path, local_greedy, split, expect,
                                                        capfd):
    import edgeinfer
    from edgeinfer.devices import last_placement

    eps = tuple(w.endpoint for w in workers)
    with edgeinfer.load(default_model_path, n_threads=1, rpc=eps, tensor_split=split) as engine:
        placement = last_placement(default_model_path)
        assert [p.n_layers for p in placement.parts] == expect
        assert engine.backend == placement.summary() and ("RPC" in engine.backend) == any(expect[1:])
        prompt, tokens = _greedy(engine)
        ref_prompt, reference = local_greedy
        assert prompt == ref_prompt
        assert_same_or_near_tie(engine, prompt, reference, tokens)
        if tokens == reference:
            print(f"split {split}: {len(tokens)} greedy tokens identical to the local run")


def test_layer_assignment_is_llama_cpps(workers, default_model_path):
    """Our plan (used by fit, and to check memory before loading) is where llama.cpp puts each layer."""
    import edgeinfer
    from edgeinfer.devices import last_placement
    from edgeinfer.llama_backend import log_capture

    said: list[str] = []
    eps = tuple(w.endpoint for w in workers)
    with log_capture(lambda _level, text: said.append(text)), \
            edgeinfer.load(default_model_path, n_threads=1, rpc=eps, tensor_split=(2.0, 1.0, 3.0)):
        placement = last_placement(default_model_path)
    log = "".join(said)
    where = {int(m[1]): m[2] for m in re.finditer(r"layer +(\d+) assigned to device (\w+)", log)}
    planned = {}
    for part in placement.parts:
        for il in range(*part.layers):
            planned[il] = "CPU" if part.name == "host" else part.name
    assert where == planned
    buffers = {m[1]: float(m[2]) for m in re.finditer(r"RPC\d\[(127\.0\.0\.1:\d+)\] model buffer size = +([\d.]+) MiB", log)}
    for part in placement.devices:  # the weights we plan on each worker are llama.cpp's buffer sizes
        assert abs(buffers[part.where] - part.weights / (1 << 20)) < 0.01


def test_keepalive_on_the_connections_to_the_workers(workers, default_model_path):
    import edgeinfer
    from edgeinfer.devices import connections

    eps = tuple(w.endpoint for w in workers)
    with edgeinfer.load(default_model_path, n_threads=1, rpc=eps, tensor_split=(1.0, 1.0, 1.0)), \
            connections.our_sockets(eps) as socks:
        assert {e for e, _fd, _s in socks} == set(eps)
        for _e, _fd, s in socks:
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1


def test_run_cli_over_two_workers_matches_local(workers):
    a, b = workers
    local = cli("run", "-p", PROMPT, "-n", "24", "--temperature", "0", "--json")
    split = cli("run", "-p", PROMPT, "-n", "24", "--temperature", "0", "--json", "--rpc", f"{a.endpoint},{b.endpoint}",
                "--tensor-split", "1,1,1", "--gpu-layers", "auto")
    assert local.returncode == 0 and split.returncode == 0, local.stderr + split.stderr
    assert json.loads(split.stdout)["tokens"] == json.loads(local.stdout)["tokens"]


def test_gpu_layers_count_goes_to_the_workers(workers, default_model_path):
    import edgeinfer
    from edgeinfer.devices import last_placement

    a, b = workers
    with edgeinfer.load(default_model_path, n_threads=1, rpc=(a.endpoint, b.endpoint), n_gpu_layers=7):
        placement = last_placement(default_model_path)
    assert placement.n_gpu_layers == 7 and placement.host.n_layers == 31 - 7
    assert sum(p.n_layers for p in placement.devices) == 7
    with edgeinfer.load(default_model_path, n_threads=1, rpc=(a.endpoint,), n_gpu_layers="all"):
        placement = last_placement(default_model_path)
    assert placement.host.n_layers == 0 and placement.devices[0].n_layers == 31


# -- what goes wrong -------------------------------------------------------------------------------------


def test_worker_killed_mid_decode_ends_the_process_with_one_line(default_model_path):
    victim, other = Worker(), Worker()
    try:
        env = dict(os.environ, EDGEINFER_THREADS="1")
        proc = subprocess.Popen(
            [*EDGEINFER, "run", "-p", "Write a very long story about a dragon and a knight.", "-n", "4000",
             "--ctx", "4096", "--temperature", "0", "--rpc", f"{other.endpoint},{victim.endpoint}",
             "--tensor-split", "1,1,1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no token within 120 s"
        assert os.read(proc.stdout.fileno(), 64)  # decoding has begun
        victim.kill()
        started = time.monotonic()
        _out, err = proc.communicate(timeout=60)  # never a hang
        print(f"ended {time.monotonic() - started:.2f} s after the worker was killed")
        text = err.decode()
        lines = [ln for ln in text.splitlines() if ln.strip()]
        assert proc.returncode == 1, text
        assert lines == [lines[0]] and lines[0].startswith(f"edgeinfer: error: lost RPC worker {victim.endpoint} "), text
        assert "GGML_ABORT" not in text and "Traceback" not in text
    finally:
        victim.stop()
        other.stop()


def test_a_worker_that_is_down_is_one_line_before_loading(default_model_path):
    import edgeinfer
    from edgeinfer.devices import RpcWorkerError

    port = free_port()
    r = cli("run", "-p", "Hi", "-n", "4", "--rpc", f"127.0.0.1:{port}")
    assert f"RPC worker 127.0.0.1:{port} is not running (connection refused)" in one_error_line(r)
    with pytest.raises(RpcWorkerError, match="not running"):
        edgeinfer.load(default_model_path, rpc=(f"127.0.0.1:{port}",))
    r = cli("fit", "--rpc", f"127.0.0.1:{port}")
    assert "is not running" in one_error_line(r)


class FakeWorker:
    """A TCP server that answers like an RPC worker of another llama.cpp (or not at all)."""

    def __init__(self, mode: str):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.mode = mode
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.recv(9 + 24)
            if self.mode == "v6":
                conn.sendall(struct.pack("<Q", 28) + bytes([6, 0, 0, 0]) + bytes(24))
                conn.recv(16)
            elif self.mode == "old":
                pass  # an older server refuses the HELLO size and hangs up
            elif self.mode == "silent":
                self.done.wait(30)

    def close(self) -> None:
        self.done.set()
        self.sock.close()
        self.thread.join(timeout=5)


@pytest.mark.parametrize("mode, message", [
    ("v6", "speaks RPC protocol v6.0.0, this build v7.0.0"),
    ("old", "closed the connection during the handshake"),
    ("silent", "did not answer within 0.5 s: it is probably serving another client"),
])
def test_a_worker_of_another_version_or_busy_is_refused(mode, message):
    from edgeinfer.devices import RpcWorkerError, probe_worker

    fake = FakeWorker(mode)
    try:
        with pytest.raises(RpcWorkerError, match=re.escape(message)):
            probe_worker(fake.endpoint, timeout=0.5)
    finally:
        fake.close()


def test_a_version_mismatch_refuses_the_load_before_weights_move(default_model_path):
    fake = FakeWorker("v6")
    try:
        r = cli("run", "-p", "Hi", "-n", "4", "--rpc", fake.endpoint)
        assert "speaks RPC protocol v6.0.0" in one_error_line(r)
    finally:
        fake.close()


# -- fit, bench, eval, doctor over workers ----------------------------------------------------------------


def test_fit_plans_over_host_and_workers_and_refuses_what_does_not_fit(workers):
    a, b = workers
    r = cli("fit", "--rpc", f"{a.endpoint},{b.endpoint}", "--tensor-split", "1,1,1", "--ctx", "2048")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.split()[:1] in (["host"], ["RPC0"], ["RPC1"])}
    assert rows["host"].split()[4] == "0-9" and a.endpoint in rows["RPC0"] and "21-30 +output" in rows["RPC1"]
    tiny = Worker("--mem", "0.05")
    try:
        r = cli("fit", "--rpc", tiny.endpoint, "--tensor-split", "0,1", "--ctx", "8192")
        assert r.returncode == 1 and "NO" in r.stdout, r.stdout + r.stderr
        r = cli("run", "-p", "Hi", "-n", "4", "--rpc", tiny.endpoint, "--tensor-split", "0,1", "--ctx", "8192")
        line = one_error_line(r)
        assert f"({tiny.endpoint}) would hold" in line and "reports 53.7 MB free" in line
        # auto puts on it only what fits
        r = cli("fit", "--rpc", tiny.endpoint, "--ctx", "8192")
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        tiny.stop()


def test_bench_shows_the_backend_and_does_not_save_a_remote_run(workers, edgeinfer_home):
    import edgeinfer

    a, b = workers
    # (A short flash-attention timing: the default 512 tokens of context, twice, over RPC, were most of the test.)
    r = cli("bench", "--rpc", f"{a.endpoint},{b.endpoint}", "--tensor-split", "1,1,1", "--prompt-tokens", "16",
            "--decode-tokens", "8", "--repeats", "1", "--flash-depth", "32")
    assert r.returncode == 0, r.stderr
    assert f"layers on CPU 10 + RPC0 {a.endpoint} 11 + RPC1 {b.endpoint} 10 (of 31 layers)" in r.stdout
    manifest = edgeinfer.Store().get("smollm2-135m-instruct:q4_1")
    assert "bench" not in manifest.metrics


def test_eval_over_a_worker_matches_local(workers):
    a, _b = workers
    common = ("eval", "smollm2-135m-instruct:q4_1", "--reference", "smollm2-135m-instruct:q4_1", "--ctx", "128",
              "--chunks", "1")
    local = cli(*common)
    remote = cli(*common, "--rpc", a.endpoint, "--tensor-split", "1,1")
    assert local.returncode == 0 and remote.returncode == 0, local.stderr + remote.stderr
    ppl = [re.search(r"PPL\s+([\d.]+)", r.stdout) for r in (local, remote)]
    assert ppl[0] and ppl[1] and ppl[0][1] == ppl[1][1], local.stdout + remote.stdout


def test_doctor_probes_workers(workers):
    from edgeinfer.devices import RPC_PROTOCOL

    a, b = workers
    r = cli("doctor", "--rpc", f"{a.endpoint},{b.endpoint}", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["rpc"] is True
    assert [tuple(w["protocol"]) for w in data["workers"]] == [RPC_PROTOCOL, RPC_PROTOCOL]
    dead = f"127.0.0.1:{free_port()}"
    r = cli("doctor", "--rpc", dead)
    assert r.returncode == 1 and f"RPC worker {dead} is not running" in r.stdout


def test_chat_and_serve_take_the_placement_flags():
    """The flags reach LoadOptions: a contradiction is refused before the screen or the server opens."""
    for command in ("chat", "serve"):
        r = cli(command, "--gpu-layers", "3", "--tensor-split", "1,1")
        line = one_error_line(r)
        assert "give a number of GPU layers or a tensor split, not both" in line, line


# -- the real 1.5B ------------------------------------------------------------------------------------------


@pytest.mark.real
def test_real_model_split_three_ways(workers, qwen_pair, qwen_engine):
    import edgeinfer
    from edgeinfer.devices import last_placement

    target, _draft = qwen_pair
    eps = tuple(w.endpoint for w in workers)
    # Flash attention off on both sides (this test checks the layout): with it on, an AMD EPYC
    # machine's three-way split parted from the local run at token 11 where the top-2 margin is
    # 0.138 (off: a near-tie at token 15, 0.019). Why the split's flash path drifts: not known yet.
    # The local run is the session's engine (tests/conftest.py: flash attention off).
    ref_prompt, reference = _greedy(qwen_engine, 16)
    for split in ((1.0, 1.0, 1.0), (1.0, 0.0, 0.0)):
        with edgeinfer.load(target, n_threads=1, n_ctx=1024, rpc=eps, tensor_split=split, flash_attn=False) as engine:
            assert sum(p.n_layers for p in last_placement(target).devices) == (0 if split[1:] == (0.0, 0.0) else 19)
            prompt, tokens = _greedy(engine, 16)
            assert prompt == ref_prompt
            print(f"split {split}: ", end="")
            assert_same_or_near_tie(engine, prompt, reference, tokens)
            if tokens == reference:
                print(f"{len(tokens)} greedy tokens identical to the local run")
