"""What llama.cpp's RPC backend costs: prefill and decode tok/s of a model run here alone, and split
over 1 and 2 `edgeinfer rpc-worker` processes on this machine (the protocol's cost without a
network), directly and through a TCP proxy that adds a round-trip delay (a network's latency).

Every configuration is loaded once (a worker serves one client, so each has workers of its own),
then rows alternate round by round and the table shows medians. On one machine the parts of a split
run one after the other on the same cores, so the compute is the same as the local run's and the
difference is the protocol: messages, copies, and the hand-over between processes. The proxy counts
what crosses it per generated token (bytes, and the turns where the direction changes: each is one
wait for the other side), from which the last column puts the split on paper on a LAN of 1 Gb/s and
0.5 ms round trips: 1 / (1 / tok_s_direct + turns × 0.5 ms + bytes / 125 MB/s).

    .venv/bin/python -m benchmarks.bench_rpc [--model PATH | --real] [--workers 0,1,2]
        [--delays-ms 0,2] [--rounds 5] [--prompt-tokens 128] [--decode-tokens 32] [--threads 2]
        [--worker-threads 2] [--omp-wait PASSIVE|ACTIVE|inherit] [--json]

Run it on a quiet machine: every process shares the same cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

PROMPT = ("Write a detailed technical explanation of how a hash map works, with its collision strategies, "
          "resizing, and the costs of each operation. ") * 40


class DelayProxy:
    """A TCP proxy to one worker that holds every chunk for `delay_s / 2` in each direction (so a
    round trip takes `delay_s` longer) and counts bytes and direction changes."""

    def __init__(self, upstream: tuple[str, int], delay_s: float):
        self.upstream, self.delay = upstream, delay_s / 2
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.bytes = [0, 0]  # to the worker, from the worker
        self.turns = 0
        self._last_dir = -1
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            up = socket.create_connection(self.upstream)
            up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for src, dst, d in ((client, up, 0), (up, client, 1)):
                threading.Thread(target=self._pump, args=(src, dst, d), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: int) -> None:
        import queue

        q: queue.Queue[tuple[float, bytes]] = queue.Queue()

        def send() -> None:
            while True:
                due, data = q.get()
                if not data:
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    return
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                try:
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=send, daemon=True).start()
        while True:
            try:
                data = src.recv(1 << 20)
            except OSError:
                data = b""
            if data:
                with self._lock:
                    self.bytes[direction] += len(data)
                    if direction != self._last_dir:
                        self.turns += direction == 0  # a new request after an answer (or the first)
                        self._last_dir = direction
            q.put((time.perf_counter() + self.delay, data))
            if not data:
                return

    def counters(self) -> tuple[int, int]:
        with self._lock:
            return self.bytes[0] + self.bytes[1], self.turns

    def close(self) -> None:
        self.server.close()


class Worker:
    def __init__(self, threads: int, env: dict[str, str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "edgeinfer", "rpc-worker", "--port", str(self.port),
                                      "--threads", str(threads)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, text=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""
        if "listening" not in line:
            self.stop()
            raise SystemExit(f"rpc-worker on port {self.port} did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@dataclass
class Config:
    name: str
    workers: int
    delay_ms: float | None  # None: no proxy
    endpoints: tuple[str, ...] = ()
    proxies: list[DelayProxy] = field(default_factory=list)
    engine: object = None
    prefill: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    bytes_per_token: list[float] = field(default_factory=list)
    turns_per_token: list[float] = field(default_factory=list)


@contextlib.contextmanager
def configs(model: str, workers: list[int], delays: list[float], threads: int, worker_threads: int,
            env: dict[str, str], n_ctx: int) -> Iterator[list[Config]]:
    import edgeinfer

    procs: list[Worker] = []
    out: list[Config] = []
    try:
        for n in workers:
            for delay in ([None] if n == 0 else [None, *delays]):
                c = Config("local" if n == 0 else f"{n} worker{'s' if n > 1 else ''}"
                           + ("" if delay is None else f", +{delay:g} ms RTT"), n, delay)
                eps = []
                for _ in range(n):
                    w = Worker(worker_threads, env)
                    procs.append(w)
                    if delay is None:
                        eps.append(f"127.0.0.1:{w.port}")
                    else:
                        proxy = DelayProxy(("127.0.0.1", w.port), delay / 1000)
                        c.proxies.append(proxy)
                        eps.append(f"127.0.0.1:{proxy.port}")
                c.endpoints = tuple(eps)
                split = (1.0,) * (n + 1) if n else ()
                print(f"… loading {c.name}", file=sys.stderr, flush=True)
                c.engine = edgeinfer.load(model, n_ctx=n_ctx, n_threads=threads, rpc=c.endpoints, tensor_split=split)
                out.append(c)
        yield out
    finally:
        for c in out:
            if c.engine is not None:
                c.engine.close()
            for p in c.proxies:
                p.close()
        for w in procs:
            w.stop()


def measure(c: Config, prompt: list[int], decode_tokens: int) -> None:
    import edgeinfer

    opts = edgeinfer.GenerateOptions(max_tokens=decode_tokens, sampling=edgeinfer.SamplingOptions(temperature=0.0))
    c.engine.reset()  # the same prompt every round: without this the engine reuses its cache (prefill 0)
    before = [p.counters() for p in c.proxies]
    done = c.engine.generate(prompt, opts).result()
    after = [p.counters() for p in c.proxies]
    c.prefill.append(done.stats.prefill_tok_s or 0.0)
    c.decode.append(done.stats.decode_tok_s or 0.0)
    if c.proxies:
        # What crossed the proxies per generated token, prefill included (a decode-only count would
        # need the split per phase; the prompt's share is small next to decode_tokens turns).
        n = max(done.stats.generated_tokens, 1)
        c.bytes_per_token.append(sum(a[0] - b[0] for a, b in zip(after, before)) / n)
        c.turns_per_token.append(sum(a[1] - b[1] for a, b in zip(after, before)) / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF path or store name (default: the default model)")
    ap.add_argument("--real", action="store_true", help="the real Qwen2.5-Coder-1.5B (tests/real_models.py)")
    ap.add_argument("--workers", default="0,1,2", help="worker counts to compare (0: local)")
    ap.add_argument("--delays-ms", default="0,2", help="added round trips through the proxy (0: the proxy alone)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="this process's llama.cpp threads")
    ap.add_argument("--worker-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--omp-wait", default="PASSIVE", help="OMP_WAIT_POLICY of every process (inherit: leave it); "
                    "idle parts of a split must not spin on the cores the active part needs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    env = dict(os.environ)
    if args.omp_wait != "inherit":
        env["OMP_WAIT_POLICY"] = os.environ["OMP_WAIT_POLICY"] = args.omp_wait  # before llama.cpp loads here
    model = args.model
    if args.real:
        from tests.real_models import qwen_pair

        model = str(qwen_pair()[0])
    workers = [int(x) for x in args.workers.split(",")]
    delays = [float(x) for x in args.delays_ms.split(",") if x.strip()]
    import edgeinfer

    with configs(model, workers, delays, args.threads, args.worker_threads, env,
                 n_ctx=max(512, args.prompt_tokens + args.decode_tokens + 64)) as rows:
        prompt = rows[0].engine.tokenize(PROMPT, add_special=True)[: args.prompt_tokens]
        for c in rows:  # warm up: first decode allocates and, over RPC, sends the graph
            c.engine.generate(prompt[:16], edgeinfer.GenerateOptions(max_tokens=2)).result()
        for r in range(args.rounds):
            for c in (rows if r % 2 == 0 else rows[::-1]):  # alternating, and in both orders
                measure(c, prompt, args.decode_tokens)
            print(f"… round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        report(rows, args)


def report(rows: list[Config], args: argparse.Namespace) -> None:
    med = statistics.median
    local = next((c for c in rows if c.workers == 0), None)
    direct = {c.workers: c for c in rows if c.delay_ms is None}
    proxied = {(c.workers, c.delay_ms): c for c in rows if c.delay_ms is not None}
    out = []
    for c in rows:
        row = {"config": c.name, "workers": c.workers, "delay_ms": c.delay_ms,
               "prefill_tok_s": round(med(c.prefill), 1), "decode_tok_s": round(med(c.decode), 2),
               "decode_vs_local": round(med(c.decode) / med(local.decode), 3) if local else None}
        if c.proxies:
            row["bytes_per_token"] = round(med(c.bytes_per_token))
            row["turns_per_token"] = round(med(c.turns_per_token), 1)
            base = direct.get(c.workers)
            if base is not None:
                # On paper: the direct split plus a LAN's round trips and transfer for what crossed.
                t = 1 / med(base.decode) + row["turns_per_token"] * 0.5e-3 + row["bytes_per_token"] / 125e6
                row["lan_1gbps_0.5ms_decode_tok_s"] = round(1 / t, 2)
                if c.delay_ms:
                    zero = proxied.get((c.workers, 0.0))
                    ref = med(zero.decode) if zero else med(base.decode)
                    row["predicted_decode_tok_s"] = round(1 / (1 / ref + row["turns_per_token"] * c.delay_ms / 1e3), 2)
        out.append(row)
    if args.json:
        print(json.dumps({"rounds": args.rounds, "prompt_tokens": args.prompt_tokens,
                          "decode_tokens": args.decode_tokens, "threads": args.threads,
                          "worker_threads": args.worker_threads, "omp_wait": args.omp_wait, "rows": out}, indent=2))
        return
    head = ["config", "prefill tok/s", "decode tok/s", "vs local", "bytes/tok", "turns/tok", "predicted", "LAN paper"]
    table = [[r["config"], f"{r['prefill_tok_s']:.1f}", f"{r['decode_tok_s']:.2f}",
              "-" if r["decode_vs_local"] is None else f"{r['decode_vs_local']:.2f}×",
              str(r.get("bytes_per_token", "-")), str(r.get("turns_per_token", "-")),
              str(r.get("predicted_decode_tok_s", "-")), str(r.get("lan_1gbps_0.5ms_decode_tok_s", "-"))] for r in out]
    widths = [max(len(x[i]) for x in [head, *table]) for i in range(len(head))]
    for line in [head, *table]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    print(f"\nmedians of {args.rounds} alternating rounds; prompt {args.prompt_tokens}, decode {args.decode_tokens} tokens; "
          f"{args.threads} threads here, {args.worker_threads} per worker; OMP_WAIT_POLICY={args.omp_wait}")
    print("predicted: the proxy-alone row plus turns × the added delay; LAN paper: the direct split plus "
          "turns × 0.5 ms + bytes / 125 MB/s")


if __name__ == "__main__":
    main()
