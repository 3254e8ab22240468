"""Time to first token of a reopened chat, with and without its saved KV state (issue 25).

For each model and chat size: an engine holds a chat of about N tokens (a long first message, then
one short greedy reply) and saves it (`Engine.save_slot`); it is closed. Then, in rounds, a new
engine — the app restarted — answers the next message of that chat:

- cold: without the state, reading the whole history again (what every reopened chat cost before);
- warm: `restore_slot` first, then the same request, which reads only the new message.

Each row reports the time from "the new engine is loaded" to the first new token (restore
included), the prompt tokens actually read, the state file's size, the save and restore times, and
the cold/warm ratio. Rows alternate within each round and the best of the rounds is kept (the
machine is shared: other load only ever slows a run down). Every engine is loaded with the same
thread count; the model load itself is not timed (the same in both cases).

    EDGEINFER_HOME=$(mktemp -d) .venv/bin/python -m benchmarks.bench_resume [--models default,qwen1.5b]
        [--sizes 1000,4000] [--rounds 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # real_models: the cached Qwen pair

import edgeinfer  # noqa: E402


def notes(n_items: int) -> str:
    towns = ["Lyon", "Porto", "Graz", "Turku", "Split", "Ghent", "Bergen", "Cork", "Brno", "Pisa"]
    lines = [f"Item {i}: the crate from {towns[i % 10]} weighs {17 * i % 97 + 3} kg and leaves on day "
             f"{i * 7 % 31 + 1}." for i in range(1, n_items + 1)]
    return "Shipping notes for this week.\n" + "\n".join(lines) + "\n\nWhich town does item 3 come from?"


def chat_of(engine: edgeinfer.Engine, size: int) -> list[dict[str, str]]:
    """A first message of about `size` tokens (with the system prompt), found by growing the notes."""
    n = 8
    while True:
        history = [{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": notes(n)}]
        got = len(engine.chat_tokens(history))
        if got >= size - 24:
            return history
        n = max(n + 1, int(n * (size - 24) / got))


def model_path(name: str) -> str | None:
    if name == "default":
        return None  # the default model (the store registers the shipped file)
    if name == "qwen1.5b":
        from real_models import qwen_pair

        return str(qwen_pair()[0])
    return name


def measure(model: str | None, size: int, rounds: int, threads: int, workdir: Path) -> dict:
    greedy = edgeinfer.SamplingOptions(temperature=0.0)
    load = dict(n_ctx=size + 512, n_threads=threads)
    state = workdir / f"chat-{size}.kv"
    with edgeinfer.load(model, **load) as engine:
        history = chat_of(engine, size)
        first = engine.chat(history, edgeinfer.GenerateOptions(max_tokens=16, sampling=greedy)).result()
        conversation = history + [{"role": "assistant", "content": first.text}]
        saved = engine.save_slot(0, state, conversation)
    request = conversation + [{"role": "user", "content": "And how heavy is item 5?"}]
    one = edgeinfer.GenerateOptions(max_tokens=1, sampling=greedy)
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for mode in ("cold", "warm"):
            with edgeinfer.load(model, **load) as engine:
                t0 = time.perf_counter()
                restore_s = 0.0
                if mode == "warm":
                    result = engine.restore_slot(0, state, request)
                    if not result:
                        raise SystemExit(f"restore refused: {result.reason}")
                    restore_s = result.seconds
                done = engine.chat(request, one).result()
                ttft = time.perf_counter() - t0
            row = {"ttft_s": ttft, "restore_s": restore_s, "prompt": done.stats.prompt_tokens,
                   "read": done.stats.prompt_tokens - done.stats.cached_tokens}
            if mode not in best or ttft < best[mode]["ttft_s"]:
                best[mode] = row
    return {"model": Path(model).name if model else edgeinfer.DEFAULT_MODEL, "size": best["cold"]["prompt"],
            "cold": best["cold"], "warm": best["warm"], "state_mb": saved.bytes / 1e6, "save_s": saved.seconds,
            "saved_tokens": saved.tokens}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default,qwen1.5b")
    ap.add_argument("--sizes", default="1000,4000")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        for name in args.models.split(","):
            for size in (int(s) for s in args.sizes.split(",")):
                r = measure(model_path(name), size, args.rounds, args.threads, Path(tmp))
                rows.append(r)
                c, w = r["cold"], r["warm"]
                print(f"{r['model']:<42} {r['size']:>5} tok | cold {c['ttft_s']:7.2f} s (read {c['read']:>5}) | "
                      f"warm {w['ttft_s']:6.2f} s (read {w['read']:>3}, restore {w['restore_s']:.2f} s) | "
                      f"{c['ttft_s'] / w['ttft_s']:6.1f}x | state {r['state_mb']:6.1f} MB, save {r['save_s']:.2f} s",
                      flush=True)


if __name__ == "__main__":
    main()
