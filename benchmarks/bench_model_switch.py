"""Time to first token of a model switch on `edgeinfer serve`, and `ps`'s memory against the RSS.

One server (the real CLI, a fresh store) with --max-loaded 2 and models configured by path in its
serve.toml (so that the first load of each goes through the child-process load check of a file the
store has never seen: validation, sha256, a load in a child, then the load). For each model, the
time to the first streamed token of a short chat request (client side), three ways:

- cold, first: the file never seen (check + load);
- the next request at once (the new engine measures its decode cost curve while idle, once per
  model file: a request arriving meanwhile interrupts it);
- cold, again: after `stop` (the file known, the curve measured: load only);
- warm: the model loaded (what a request pays with keep-alive).

Then a switch between two loaded models (warm, alternating), and a switch that evicts (a third
model with two loaded). Memory: for each model alone (the others stopped), the server's RSS growth
(/proc/PID/status) after a short request and after a long prompt (which touches the compute
buffers), beside `ps`'s estimate by part. The machine is shared: 1 thread, a few repeats.

    .venv/bin/python benchmarks/bench_model_switch.py [--models PATH,PATH] [--repeats 3] [--ctx 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx

QWEN = Path.home() / ".cache" / "edgeinfer-test-models"


def default_models() -> list[Path]:
    from edgeinfer.default_model import default_model_file

    out = [default_model_file()]
    out += [p for p in (QWEN / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", QWEN / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
            if p.exists()]
    return [p for p in out if p is not None]


class Server:
    def __init__(self, home: Path, *args: str):
        env = dict(os.environ, EDGEINFER_HOME=str(home), EDGEINFER_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "edgeinfer", "serve", *args, "--port", "0"],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.base = ""
        while not self.base:
            line = self.lines.get(timeout=300)
            if line is None:
                raise SystemExit("the server exited before it was ready")
            if " at http://" in line:
                self.base = line.split(" at ", 1)[1].split()[0].removesuffix("/v1")

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def ttft(self, model: str, content: str = "Say hello.") -> float:
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                "temperature": 0.0, "stream": True}
        start = time.perf_counter()
        with httpx.stream("POST", self.base + "/v1/chat/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                raise SystemExit(f"{model}: {r.status_code} {r.read().decode()}")
            first = None
            for line in r.iter_lines():
                if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - start
        return first if first is not None else float("nan")

    def calibrated(self, timeout: float = 180) -> float:
        """Wait until no loaded model is measuring its cost curve (an idle engine's first job,
        kept in the store: once per model file); the seconds waited."""
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if not httpx.get(self.base + "/health", timeout=60).json().get("calibrating"):
                break
            time.sleep(0.5)
        return time.perf_counter() - start

    def ps(self) -> dict:
        return httpx.get(self.base + "/edgeinfer/ps", timeout=60).json()

    def stop_model(self, model: str) -> None:
        httpx.post(self.base + "/edgeinfer/stop", json={"model": model}, timeout=60)

    def stop_all(self) -> None:
        for m in self.ps()["models"]:
            self.stop_model(m["name"])

    def rss(self) -> dict[str, int]:
        """The server's resident memory (/proc/PID/status): all, mapped files, anonymous."""
        keys = {"VmRSS": "rss", "RssFile": "file", "RssAnon": "anon"}
        out = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in keys:
                out[keys[name]] = int(value.split()[0]) * 1024
        return out

    def close(self) -> None:
        self.proc.send_signal(2)
        self.proc.wait(timeout=60)


def mb(n: float) -> str:
    return f"{n / 1e6:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help="comma-separated GGUF paths (default: the default model and the Qwen pair)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=2048)
    args = ap.parse_args()
    files = [Path(p) for p in args.models.split(",")] if args.models else default_models()
    work = Path(tempfile.mkdtemp(prefix="bench-switch-"))
    try:
        home = work / "home"
        home.mkdir()
        aliases = []
        table = f"[defaults]\nparallel = 1\nctx = {args.ctx}\nthreads = 1\n"
        for i, f in enumerate(files):
            # a copy the store has never seen: its first load runs the child-process check
            fresh = work / f"m{i}-{f.name}"
            shutil.copyfile(f, fresh)
            alias = f"m{i}"
            aliases.append((alias, f.name, f.stat().st_size))
            table += f'\n[models."{fresh}"]\nalias = ["{alias}"]\n'
        (home / "serve.toml").write_text(table)
        server = Server(home, "--threads", "1", "--parallel", "1", "--ctx", str(args.ctx), "--max-loaded", "2",
                        "--keep-alive", "-1")
        try:
            server.stop_all()  # the default model was preloaded: start from nothing
            print(f"load average {os.getloadavg()[0]:.2f}; {args.repeats} repeats; 1 thread; ctx {args.ctx}; "
                  "time to first token (s), client side, of a 4-token streamed chat\n")
            print("| model | size | cold, never seen (check + load) | its load_s | next request, calibrating | "
                  "cold, known | warm (loaded) |")
            print("| --- | --- | --- | --- | --- | --- | --- |")
            for alias, name, size in aliases:
                first = server.ttft(alias)
                load_first = next(m["load_s"] for m in server.ps()["models"] if alias in m["aliases"])
                during = server.ttft(alias)  # the idle calibration started after the first request
                server.calibrated()
                again = []
                for _ in range(args.repeats):
                    server.stop_model(alias)
                    again.append(server.ttft(alias))
                warm = [server.ttft(alias) for _ in range(args.repeats)]
                print(f"| {name} | {size / 1e6:.0f} MB | {first:.2f} | {load_first:.2f} | {during:.2f} | "
                      f"{statistics.median(again):.2f} | {statistics.median(warm):.3f} |")
                server.stop_model(alias)
            # switches
            a, b = aliases[0][0], aliases[-1][0]
            server.ttft(a)
            server.ttft(b)
            warm_switch = []
            for i in range(args.repeats * 2):
                warm_switch.append(server.ttft(a if i % 2 == 0 else b))
            print(f"\nwarm switch {aliases[0][1]} <-> {aliases[-1][1]} (both loaded): median "
                  f"{statistics.median(warm_switch):.3f} s")
            if len(aliases) >= 3:
                mid = aliases[1][0]
                evicting = server.ttft(mid)  # two loaded: the least recently used goes
                print(f"switch to {aliases[1][1]} evicting one of two loaded (file known): {evicting:.2f} s")
            # memory
            print("\n| model alone | ps: weights | repacked | KV | compute | total | RSS growth, short request | "
                  "after a long prompt | of which mapped file / anonymous |")
            print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
            long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 120)  # ~1200 tokens
            for alias, name, _size in aliases:
                server.stop_all()
                time.sleep(0.5)
                empty = server.rss()
                server.ttft(alias)
                short = server.rss()["rss"] - empty["rss"]
                server.ttft(alias, long_prompt)
                after = server.rss()
                long = after["rss"] - empty["rss"]
                (m,) = [m for m in server.ps()["models"] if alias in m["aliases"]]
                mem = m["memory"]
                print(f"| {name} | {mb(mem['weights'])} | {mb(mem['repack'])} | {mb(mem['kv_cache'])} | "
                      f"{mb(mem['compute'])} | {mb(mem['total'])} | {mb(short)} ({short / mem['total']:.2f}) | "
                      f"{mb(long)} ({long / mem['total']:.2f}) | {mb(after['file'] - empty['file'])} / "
                      f"{mb(after['anon'] - empty['anon'])} |")
            print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
        finally:
            server.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
