"""`edgeinfer serve` under concurrent clients: throughput, per-request decode speed and TTFT.

For each concurrency c in --concurrency (default 1,2,4,8), c clients each send one streaming
greedy chat request at the same moment; a round measures total generated tokens / wall time
(throughput), and per request the decode rate ((tokens - 1) / (last token - first token)) and the
time to the first token. Rows: our server with speculation off, prompt lookup and auto (a per-request
field on one server), and `llama-server -np N` (llama.cpp's own server, built from the sources
llama-cpp-python 0.3.36 vendors, by benchmarks/build_llama_tools.sh) when it is there. Rows alternate
within each round so machine load hits them alike; the table shows medians over rounds and the
load average seen. The machine is shared: read ratios, not absolute numbers.

    .venv/bin/python benchmarks/bench_serve.py [--model PATH|REF] [--rounds 3] [--tokens 128]
        [--concurrency 1,2,4,8] [--parallel 8] [--ctx 8192] [--threads 2] [--workload code|snippet|chat]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package ships with

WORKLOADS = Path(__file__).resolve().parent / "workloads"
TOOLS = Path(os.environ.get("EDGEINFER_LLAMA_TOOLS", Path.home() / ".cache" / "edgeinfer-llama-tools"))


def prompts(kind: str, n: int, tag: str = "") -> list[str]:
    """n different prompts. `tag` starts each one, so that no request finds its prompt in a
    slot's (or llama-server's) cache from an earlier round: TTFT includes the prefill."""
    return [f"[{tag}{i}] {p}" for i, p in enumerate(_prompts(kind, n))]


def _prompts(kind: str, n: int) -> list[str]:
    if kind == "code":
        code = (WORKLOADS / "code_edit.py").read_text()
        names = ["compute_total", "needs_reorder", "reorder_list", "apply_discount"]
        return [f"Here is a Python file:\n\n```python\n{code}```\n\nReturn the whole file unchanged except that the "
                f"function {names[i % len(names)]} is renamed to renamed_{i}." for i in range(n)]
    if kind == "snippet":  # a short copy-with-edit: little prefill, much for lookup to copy
        code = (WORKLOADS / "code_edit.py").read_text()
        start = code.index("def compute_total")
        snippet = code[start : code.index("def apply_discount")]
        return [f"Rewrite this code with the variable `item` renamed to `entry_{i}`:\n\n```python\n{snippet}```"
                for i in range(n)]
    topics = ["a lighthouse keeper", "a robot who paints", "a lost cat", "the first day of school", "a dragon",
              "a storm at sea", "a city garden", "a train journey"]
    return [f"Write a short story about {topics[i % len(topics)]}." for i in range(n)]


class Process:
    """A server subprocess; ready when `ready_line` appears on its output."""

    def __init__(self, cmd: list[str], ready: str, env: dict | None = None):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env or os.environ.copy())
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        self.first_line = ""
        while True:
            line = lines.get(timeout=300)
            if line is None:
                raise RuntimeError(f"{cmd[0]} exited before it was ready")
            if ready in line:
                self.first_line = line
                break

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def one_request(url: str, prompt: str, tokens: int, extra: dict, out: dict) -> None:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    t0 = time.perf_counter()
    first = last = None
    n_chunks = 0
    usage = None
    spec = {}
    with httpx.Client(timeout=600) as http, http.stream("POST", url + "/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("edgeinfer"):
                spec = chunk["edgeinfer"].get("speculation") or {}
            for c in chunk.get("choices") or []:
                if c.get("delta", {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n_chunks += 1
    n = usage["completion_tokens"] if usage else n_chunks
    out.update(drafted=spec.get("drafted", 0), accepted=spec.get("accepted", 0), tokens=n, ttft=(first or t0) - t0, decode=(n - 1) / (last - first) if first and last and last > first else 0.0,
               end=time.perf_counter())


def round_of(url: str, texts: list[str], tokens: int, extra: dict) -> dict:
    results = [dict() for _ in texts]
    barrier = threading.Barrier(len(texts))

    def client(i: int) -> None:
        barrier.wait()
        one_request(url, texts[i], tokens, extra, results[i])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["end"] for r in results) - t0
    return {"throughput": sum(r["tokens"] for r in results) / wall,
            "decode": statistics.median(r["decode"] for r in results),
            "ttft": statistics.median(r["ttft"] for r in results),
            "tokens": sum(r["tokens"] for r in results),
            "drafted": sum(r["drafted"] for r in results), "accepted": sum(r["accepted"] for r in results)}


def _drafting(rows: list[dict]) -> str:
    drafted = sum(s["drafted"] for s in rows)
    if not drafted:
        return "- | -"
    return f"{drafted / sum(s['tokens'] for s in rows):.2f} | {sum(s['accepted'] for s in rows) / drafted:.0%}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="store ref or .gguf (default: an F16 copy of the default model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=8192, help="whole context, split between the slots")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workload", choices=("code", "snippet", "chat"), default="code")
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--speculation", default="off,lookup,auto", help="our rows: speculation per request")
    args = ap.parse_args()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background by a shell
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C/kill -INT still stops the servers
    levels = [int(c) for c in args.concurrency.split(",")]

    home = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    env = dict(os.environ, EDGEINFER_HOME=str(home), OMP_WAIT_POLICY="PASSIVE")
    model = args.model
    if model is None:
        import warnings

        from edgeinfer import Store
        from edgeinfer.default_model import default_model_file
        from edgeinfer.quantize import quantize_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = str(quantize_model(default_model_file(), "F16", store=Store(home), allow_requantize=True,
                                       name="bench").path)
    elif not model.endswith(".gguf"):
        from edgeinfer import Store

        model = str(Store().resolve(model)[0])

    ours = Process([sys.executable, "-m", "edgeinfer", "serve", model, "--port", "0", "--parallel", str(args.parallel),
                    "--ctx", str(args.ctx), "--threads", str(args.threads)], " at http://", env)
    our_url = ours.first_line.split(" at ", 1)[1].split()[0]
    servers = {f"edgeinfer {spec}": (our_url, {"speculation": spec}) for spec in args.speculation.split(",")}
    theirs = None
    llama_server = TOOLS / "bin" / "llama-server"
    if not args.no_llama_server and llama_server.exists():
        port = 18000 + os.getpid() % 1000
        theirs = Process([str(llama_server), "-m", model, "-np", str(args.parallel), "-c", str(args.ctx), "-t",
                          str(args.threads), "--port", str(port), "--host", "127.0.0.1"], "listening on http", env)
        servers[f"llama-server -np {args.parallel}"] = (f"http://127.0.0.1:{port}/v1", {})
    else:
        print(f"(no llama-server at {llama_server}: run benchmarks/build_llama_tools.sh for that row)", file=sys.stderr)

    try:
        samples: dict[tuple[str, int], list[dict]] = {}
        loads: list[float] = []
        for url, extra in servers.values():  # warm-up: page faults and the cost calibration
            round_of(url, prompts(args.workload, 1, "warm-up "), 4, extra)
        for rnd in range(args.rounds):
            for c in levels:
                names = list(servers)
                if rnd % 2:
                    names.reverse()  # alternate the order within the round
                for name in names:
                    url, extra = servers[name]
                    texts = prompts(args.workload, c, f"round {rnd} {name} ")
                    loads.append(os.getloadavg()[0])
                    samples.setdefault((name, c), []).append(round_of(url, texts, args.tokens, extra))
                    print(f"round {rnd + 1} c={c} {name}: {samples[(name, c)][-1]}", file=sys.stderr)
    finally:
        ours.stop()
        if theirs is not None:
            theirs.stop()

    print(f"\nmodel {Path(model).name}, {args.workload} workload, greedy, {args.tokens} tokens per request, "
          f"{args.parallel} slots, {args.threads} threads, median of {args.rounds} rounds; "
          f"load average during the run {min(loads):.1f}-{max(loads):.1f}\n")
    print("| server | clients | total tok/s | per-request decode tok/s | TTFT s | vs edgeinfer off "
          "| drafted per token | accepted |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in levels:
        base = statistics.median(s["throughput"] for s in samples[("edgeinfer off", c)])
        for name in servers:
            rows = samples[(name, c)]
            thr = statistics.median(s["throughput"] for s in rows)
            print(f"| {name} | {c} | {thr:.1f} | {statistics.median(s['decode'] for s in rows):.1f} | "
                  f"{statistics.median(s['ttft'] for s in rows):.3f} | {thr / base:.2f}× | {_drafting(rows)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
