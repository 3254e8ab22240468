"""`edgeinfer serve` under concurrent clients, side by side with `llama-server -np N`.

Modes:

- rounds (default): for each concurrency c in --concurrency, c clients each send one streaming greedy
  chat request at the same moment; a round measures total generated tokens / wall time (throughput),
  and per request the decode rate ((tokens - 1) / (last token - first token)) and the time to the
  first token. Rows: our server with each --speculation value (a per-request field on one server,
  started with --speculate lookup, or draft=/self= when a row needs it), and `llama-server -np N`
  (llama.cpp's own server, built from the sources llama-cpp-python 0.3.36 vendors, by
  benchmarks/build_llama_tools.sh) when it is there. Rows alternate within each round so machine
  load hits them alike; rows on servers of their own get the same prompts in a round, so they do the
  same work (the table counts the answers identical to llama-server's), and tokens are the answers'
  own on both servers (llama-server's usage adds the end-of-generation token). The table shows
  medians over rounds, ratios against llama-server (of the medians, and paired per round) and the
  load average seen.
- --first-request: a fresh server (fresh store: nothing measured before) per row and round, and
  the time to first token of its very first request: what a `--speculate lookup` server's first
  user waits beside a plain server's.

Workloads: `snippet` (a short copy-with-edit), `chat300` (~300-token prompts, one passage each),
`story` (free chat), and three code edits of benchmarks/workloads/code_edit.py of different shapes:
`edit-few` (a rename that changes a few lines), `edit-rewrite` (type hints added to most lines),
`edit-add` (a new function added). The machine is shared: read ratios, not absolute numbers.

    .venv/bin/python benchmarks/bench_serve.py [--model PATH|REF] [--rounds 3] [--tokens 128]
        [--concurrency 1,2,4,8] [--parallel 8] [--ctx 8192] [--threads 2] [--workload snippet]
        [--speculation off,lookup,auto] [--draft PATH] [--self-quant Q4_0] [--first-request] [--before TREE]

--before TREE adds a row served by another checkout (e.g. `git worktree add /tmp/before COMMIT` with its
own .venv) for the first --speculation value: a change's before and after side by side in one run.
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
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package ships with

WORKLOADS = Path(__file__).resolve().parent / "workloads"
TOOLS = Path(os.environ.get("EDGEINFER_LLAMA_TOOLS", Path.home() / ".cache" / "edgeinfer-llama-tools"))
EDITS = {
    "edit-few": "Rename the function compute_total to total_stock_value everywhere in this file and return the "
                "whole file.",
    "edit-rewrite": "Add a one-line docstring to every function that has none, and return the whole file.",
    "edit-add": "Add a function apply_tax(items, rate) after apply_discount that returns the items with their "
                "price multiplied by (1 + rate), and return the whole file.",
}


def prompts(kind: str, n: int, tag: str = "") -> list[str]:
    """n different prompts. `tag` starts each one, so that no request finds its prompt in a
    slot's (or llama-server's) cache from an earlier round: TTFT includes the prefill."""
    return [f"[{tag}{i}] {p}" for i, p in enumerate(_prompts(kind, n))]


def _prompts(kind: str, n: int) -> list[str]:
    code = (WORKLOADS / "code_edit.py").read_text()
    if kind in EDITS:
        return [f"{EDITS[kind]}\n\n```python\n{code}```"] * n
    if kind == "code":
        names = ["compute_total", "needs_reorder", "reorder_list", "apply_discount"]
        return [f"Here is a Python file:\n\n```python\n{code}```\n\nReturn the whole file unchanged except that the "
                f"function {names[i % len(names)]} is renamed to renamed_{i}." for i in range(n)]
    if kind == "snippet":  # a short copy-with-edit: little prefill, much for lookup to copy
        start = code.index("def compute_total")
        snippet = code[start : code.index("def apply_discount")]
        return [f"Rewrite this code with the variable `item` renamed to `entry_{i}`:\n\n```python\n{snippet}```"
                for i in range(n)]
    if kind == "chat300":  # ~300-token prompts: a passage and a question about it
        passage = (WORKLOADS / "rag_passage.txt").read_text().strip()
        questions = ["Summarize the passage in three sentences.", "What is the main claim of the passage?",
                     "List the facts the passage gives, one per line.", "Explain the passage to a child.",
                     "What questions does the passage leave open?", "Rewrite the passage as a short poem.",
                     "Give the passage a title and explain it.", "Which sentence of the passage matters most?"]
        return [f"Read this passage.\n\n{passage}\n\n{questions[i % len(questions)]} Quote the sentences you use."
                for i in range(n)]
    topics = ["a lighthouse keeper", "a robot who paints", "a lost cat", "the first day of school", "a dragon",
              "a storm at sea", "a city garden", "a train journey"]
    return [f"Write a short story about {topics[i % len(topics)]}." for i in range(n)]


class Process:
    """A server subprocess; ready when `ready_line` appears on its output."""

    def __init__(self, cmd: list[str], ready: str, env: dict | None = None, cwd: Path | None = None):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env or os.environ.copy(), cwd=cwd)
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        self.first_line = ""
        while True:
            line = lines.get(timeout=600)
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


def one_request(url: str, model: str, prompt: str, tokens: int, extra: dict, out: dict,
                counts_eos: bool = False) -> None:
    """One streamed chat request; `out` gets its generated tokens, TTFT, decode rate and text.
    counts_eos: the server counts the end-of-generation token in `completion_tokens` (llama-server
    does: 2 for a one-token answer that ends by EOS), so one is taken off an answer that stopped, and
    both servers' rows count the tokens of their text."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, **extra}
    t0 = time.perf_counter()
    first = last = None
    n_chunks = 0
    usage = None
    spec = {}
    finish = None
    text = []
    with httpx.Client(timeout=900) as http, http.stream("POST", url + "/chat/completions", json=body) as r:
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
                finish = c.get("finish_reason") or finish
                if c.get("delta", {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n_chunks += 1
                    text.append(c["delta"]["content"])
    n = usage["completion_tokens"] if usage else n_chunks
    if counts_eos and finish == "stop":
        n -= 1
    out.update(drafted=spec.get("drafted", 0), accepted=spec.get("accepted", 0), tokens=n, ttft=(first or t0) - t0,
               decode=(n - 1) / (last - first) if first and last and last > first else 0.0, end=time.perf_counter(),
               text="".join(text))


def round_of(url: str, model: str, texts: list[str], tokens: int, extra: dict, counts_eos: bool = False) -> dict:
    results = [dict() for _ in texts]
    barrier = threading.Barrier(len(texts))

    def client(i: int) -> None:
        barrier.wait()
        one_request(url, model, texts[i], tokens, extra, results[i], counts_eos)

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
            "drafted": sum(r["drafted"] for r in results), "accepted": sum(r["accepted"] for r in results),
            "texts": [r["text"] for r in results]}


def _drafting(rows: list[dict]) -> str:
    drafted = sum(s["drafted"] for s in rows)
    if not drafted:
        return "- | -"
    return f"{drafted / sum(s['tokens'] for s in rows):.2f} | {sum(s['accepted'] for s in rows) / drafted:.0%}"


class Servers:
    """Our servers (one per --speculate the rows need) and llama-server, started once."""

    def __init__(self, args: argparse.Namespace, model: str, env: dict):
        self.args, self.model, self.env = args, model, env
        self.ours: dict[str, Process] = {}
        self.theirs: Process | None = None

    def ours_for(self, speculate: str, home: Path | None = None, tree: Path | None = None) -> tuple[Process, str]:
        """Our server with --speculate `speculate`; `tree`: another checkout's (its own .venv), the
        `before` row of a before/after comparison, with a store of its own."""
        key = speculate if tree is None else f"{speculate}@{tree}"
        if key not in self.ours or home is not None:
            env = dict(self.env, EDGEINFER_HOME=str(home)) if home is not None else self.env
            python = sys.executable
            if tree is not None:
                python = str(tree / ".venv" / "bin" / "python")
                env = dict(env, EDGEINFER_HOME=tempfile.mkdtemp(prefix="bench-serve-before-"))
            a = self.args
            proc = Process([python, "-m", "edgeinfer", "serve", self.model, "--port", "0", "--parallel",
                            str(a.parallel), "--ctx", str(a.ctx), "--threads", str(a.threads), "--speculate",
                            speculate], " at http://", env, cwd=tree)  # (`-m` imports from the cwd first)
            if home is not None:
                return proc, proc.first_line.split(" at ", 1)[1].split()[0]
            self.ours[key] = proc
            _settled(proc.first_line.split(" at ", 1)[1].split()[0])
        p = self.ours[key]
        return p, p.first_line.split(" at ", 1)[1].split()[0]

    def llama_server(self) -> str | None:
        binary = TOOLS / "bin" / "llama-server"
        if self.args.no_llama_server or not binary.exists():
            return None
        if self.theirs is None:
            a = self.args
            port = 18000 + os.getpid() % 1000
            self.theirs = Process([str(binary), "-m", self.model, "-np", str(a.parallel), "-c", str(a.ctx), "-t",
                                   str(a.threads), "--port", str(port), "--host", "127.0.0.1"], "listening on http",
                                  self.env)
            self.port = port
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        for p in self.ours.values():
            p.stop()
        if self.theirs is not None:
            self.theirs.stop()


@dataclass
class Row:
    """One row of the table: a server, its model id and the request fields of the row."""
    url: str
    model: str
    extra: dict
    own_prompts: bool = False  # shares its server with an earlier row: prompts of its own
    counts_eos: bool = False  # see one_request


def server_for(row: str, args: argparse.Namespace) -> tuple[str, dict]:
    """(--speculate of the server, the request's extra fields) of one of our rows."""
    if row.startswith("draft"):
        return f"draft={args.draft}", {"speculation": "draft"}
    if row.startswith("self"):
        return f"self={args.self_quant}", {"speculation": "self"}
    if row == "off":  # a plain server (its first request is what a user of one waits)
        return "off", {"speculation": "off"}
    return "lookup", {"speculation": row}


def _settled(url: str, limit_s: float = 600) -> None:
    """Wait until a new server of ours has measured its cost curve (it does while idle): its
    calibration must not run while another row is being measured."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not httpx.get(url.removesuffix("/v1") + "/health", timeout=30).json().get("calibrating"):
            return
        time.sleep(1)


def model_id(url: str) -> str:
    return httpx.get(url + "/models", timeout=30).json()["data"][0]["id"]


def run_rounds(args: argparse.Namespace, servers: Servers) -> None:
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: dict[str, Row] = {}
    servers_seen: set[str] = set()
    for row in args.speculation.split(","):
        speculate, extra = server_for(row, args)
        _, url = servers.ours_for(speculate)
        # Rows on servers of their own get the same prompts in a round (the same work, the same
        # answers but for near-ties); a row sharing a server with an earlier one gets its own, or it
        # would find the earlier row's prompts in the slots' caches.
        rows[f"edgeinfer {row}"] = Row(url, model_id(url), extra, own_prompts=speculate in servers_seen)
        servers_seen.add(speculate)
    if args.before:  # the same rows' first speculation, served by another checkout (before a change)
        row = args.speculation.split(",")[0]
        speculate, extra = server_for(row, args)
        _, url = servers.ours_for(speculate, tree=Path(args.before).resolve())
        rows[f"edgeinfer {row} (before: {Path(args.before).name})"] = Row(url, model_id(url), extra)
    peer = servers.llama_server()
    if peer is not None:
        rows[f"llama-server -np {args.parallel}"] = Row(peer, model_id(peer), {}, counts_eos=True)
    else:
        print(f"(no llama-server at {TOOLS / 'bin'}: run benchmarks/build_llama_tools.sh for that row)", file=sys.stderr)
    samples: dict[tuple[str, str, int], list[dict]] = {}
    loads: list[float] = []
    for row in rows.values():  # warm-up: page faults
        round_of(row.url, row.model, prompts("snippet", 1, "warm-up "), 4, row.extra, row.counts_eos)
    for rnd in range(args.rounds):
        for workload in args.workload.split(","):
            for c in levels:
                names = list(rows)
                names = names[rnd % len(names):] + names[: rnd % len(names)]  # rotate the order between rounds
                for name in names:
                    row = rows[name]
                    texts = prompts(workload, c, f"round {rnd} c{c} " + (f"{name} " if row.own_prompts else ""))
                    loads.append(os.getloadavg()[0])
                    sample = round_of(row.url, row.model, texts, args.tokens, row.extra, row.counts_eos)
                    samples.setdefault((workload, name, c), []).append(sample)
                    shown = {k: v for k, v in sample.items() if k != "texts"}
                    print(f"round {rnd + 1} {workload} c={c} {name}: {shown}", file=sys.stderr)
    print(f"\nmodel {Path(servers.model).name}, greedy, {args.tokens} tokens per request, {args.parallel} slots, "
          f"--ctx {args.ctx}, {args.threads} threads, median of {args.rounds} rounds; load average during the run "
          f"{min(loads):.1f}-{max(loads):.1f}; tokens are the answers' own (llama-server's usage counts "
          "the end-of-generation token too: taken off)\n")
    ref = f"llama-server -np {args.parallel}" if peer is not None else "edgeinfer off"
    for workload in args.workload.split(","):
        print(f"\n{workload}:\n")
        print(f"| server | clients | total tok/s | × {ref} | paired × {ref} (range) | TTFT s (median) | × {ref} "
              "| per-request decode tok/s | drafted per token | accepted | answers as {ref}'s |".replace("{ref}", ref))
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for c in levels:
            base = samples.get((workload, ref, c))
            base_thr = statistics.median(s["throughput"] for s in base) if base else float("nan")
            base_ttft = statistics.median(s["ttft"] for s in base) if base else float("nan")
            for name in rows:
                got = samples[(workload, name, c)]
                thr = statistics.median(s["throughput"] for s in got)
                ttft = statistics.median(s["ttft"] for s in got)
                paired = sorted(g["throughput"] / b["throughput"] for g, b in zip(got, base)) if base else []
                pair = f"{statistics.median(paired):.2f}× ({paired[0]:.2f}–{paired[-1]:.2f})" if paired else "-"
                same = "-"
                if base and not rows[name].own_prompts:
                    same_n = sum(x == y for g, b in zip(got, base) for x, y in zip(g["texts"], b["texts"]))
                    same = f"{same_n} of {sum(len(g['texts']) for g in got)}"
                print(f"| {name} | {c} | {thr:.2f} | {thr / base_thr:.2f}× | {pair} | {ttft:.2f} | "
                      f"{ttft / base_ttft:.2f}× | {statistics.median(s['decode'] for s in got):.2f} | {_drafting(got)} "
                      f"| {same} |")


def run_first_requests(args: argparse.Namespace, servers: Servers) -> None:
    """A fresh server (and store) per row and round: its first request's time to first token."""
    ttfts: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        for row in args.speculation.split(","):
            speculate, extra = server_for(row, args)
            home = Path(tempfile.mkdtemp(prefix="bench-serve-first-"))
            proc, url = servers.ours_for(speculate, home)
            try:
                out: dict = {}
                text = prompts(args.workload.split(",")[0], 1, f"first {rnd} {row} ")[0]
                one_request(url, model_id(url), text, args.tokens, extra, out)
                ttfts.setdefault(row, []).append(out["ttft"])
                print(f"round {rnd + 1} {row}: first TTFT {out['ttft']:.2f} s", file=sys.stderr)
            finally:
                proc.stop()
    base = statistics.median(ttfts[args.speculation.split(",")[0]])
    print(f"\nthe first request of a fresh server ({args.workload}, {args.tokens} tokens, median of {args.rounds}):\n")
    print("| server | first-request TTFT s | × first row | every run |")
    print("| --- | ---: | ---: | --- |")
    for row, values in ttfts.items():
        med = statistics.median(values)
        print(f"| edgeinfer --speculate {server_for(row, args)[0]} ({row}) | {med:.2f} | {med / base:.2f}× | "
              f"{', '.join(f'{v:.2f}' for v in values)} |")


def model_file(model: str | None, home: Path) -> str:
    """The .gguf to serve: `model` (a path, or a ref of the user's store), or an F16 copy of the
    default model made in the store at `home`."""
    if model is None:
        import warnings

        from edgeinfer import Store
        from edgeinfer.default_model import default_model_file
        from edgeinfer.quantize import quantize_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return str(quantize_model(default_model_file(), "F16", store=Store(home), allow_requantize=True,
                                      name="bench").path)
    if not model.endswith(".gguf"):
        from edgeinfer import Store

        return str(Store().resolve(model)[0])
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="store ref or .gguf (default: an F16 copy of the default model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=8192, help="whole context, split between the slots")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workload", default="snippet", help="snippet, chat300, story, code, edit-few, edit-rewrite, "
                    "edit-add (comma-separated)")
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--speculation", default="off,lookup,auto",
                    help="our rows: off, lookup, auto (per request), draft (--draft), self (--self-quant)")
    ap.add_argument("--draft", help="draft model for the 'draft' row (a .gguf)")
    ap.add_argument("--self-quant", default="Q4_0", help="the self-draft's quant type for the 'self' row")
    ap.add_argument("--before", metavar="TREE", help="also a row served by another checkout of edgeinfer (its own "
                    ".venv), e.g. a worktree of the commit before a change: before and after in one run")
    ap.add_argument("--first-request", action="store_true", help="time the first request of fresh servers")
    args = ap.parse_args()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background by a shell
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C/kill -INT still stops the servers

    home = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    env = dict(os.environ, EDGEINFER_HOME=str(home))
    servers = Servers(args, model_file(args.model, home), env)
    try:
        if args.first_request:
            run_first_requests(args, servers)
        else:
            run_rounds(args, servers)
    finally:
        servers.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
