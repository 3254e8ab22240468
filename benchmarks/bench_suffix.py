"""Drafts from earlier answers: a sequence of similar requests with `suffix` and `auto` against `off`,
beside llama.cpp's `llama-lookup -lcd` (its dynamic n-gram cache carried across the same requests).

Two sequences on the real Qwen2.5-Coder-1.5B (Q4_K_M), greedy: `tools`, eight agent-style requests
each answered by one JSON tool call of the same shape with other values, and `tests`, six "write the
next test like these" requests over one small module. Each round runs every row over the whole
sequence, rows alternating (their order rotates per round); every row starts cold (a fresh memory
scope; a fresh -lcd cache file), so request 1 of each sequence has nothing remembered and requests
2..n have the earlier answers of the same row only. Printed: decode tok/s of requests 2..n (their
tokens over their decode seconds), the median over rounds, the ratio to `off` (same rounds), and
whether every row's text equals `off`'s. llama-lookup's rows are beside its own plain run
(`llama-lookup` needs a draft: its plain row is `llama-bench -n` at the same depth, not a peer of
ours but of its own kernels). The tools come from benchmarks/build_llama_tools.sh.

    .venv/bin/python -m benchmarks.bench_suffix [--rounds 2] [--sequences tools,tests] [--rows off,suffix,auto,llama-lookup]
        [--tokens 96] [--model GGUF] [--fresh] [--record FILE]

Row `oracle` (benchmarks/oracle_drafter.py): the engine drafting `off`'s own answer wherever the
request's text or the earlier answers continue it, at the lengths cheapest on the cost curve
(measured at the prompts' depth, or read from `--record`, replay_suffix's file): the ceiling of any
`suffix`/`auto` policy on this engine and machine.

`--fresh`: after each of our rows' sequence, one more request in the same memory scope that
repeats none of it (FRESH, a coding question): its decode tok/s against `off`'s, the floor being
that a warm tree costs nothing where it does not help.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.bench_batch_curve import TOOLS
from benchmarks.bench_llama_peers import DECODED

CALLS = [("Paris", "celsius", 3, False), ("Denver", "fahrenheit", 5, True), ("Osaka", "celsius", 1, True),
         ("Lagos", "celsius", 7, False), ("Quebec City", "celsius", 2, False), ("Austin", "fahrenheit", 4, True),
         ("Reykjavik", "celsius", 10, False), ("Mumbai", "celsius", 6, True)]

TOOL_SYSTEM = ("You are an agent with one tool, get_weather(city: str, unit: 'celsius'|'fahrenheit', days: int, "
               "include_hourly: bool, language: str). Answer every request with exactly one JSON object "
               '{"tool": "get_weather", "arguments": {...}} with all five arguments and nothing else.')

MODULE = '''def slugify(text: str) -> str:
    return "-".join(text.lower().split())


def clamp(x: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, x))


def chunks(items: list, n: int) -> list[list]:
    return [items[i : i + n] for i in range(0, len(items), n)]


def initials(name: str) -> str:
    return "".join(part[0].upper() for part in name.split())


def is_palindrome(text: str) -> bool:
    t = "".join(c.lower() for c in text if c.isalnum())
    return t == t[::-1]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def count_words(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for w in text.split():
        out[w] = out.get(w, 0) + 1
    return out
'''

TESTS = '''import pytest

from utils import slugify


def test_slugify_joins_lower_case_words_with_dashes():
    assert slugify("Hello World") == "hello-world"
    assert slugify("  many   spaces here ") == "many-spaces-here"
    assert slugify("") == ""
'''

NEXT = ["clamp", "chunks", "initials", "is_palindrome", "mean", "count_words"]

# replay_speculation's "coding question": nothing in either sequence answers it.
FRESH = [{"role": "user", "content": "Write a Python function that parses an ISO 8601 duration like P3DT4H12M into "
          "seconds, with a docstring and three doctests."}]


def sequences() -> dict[str, list[list[dict[str, str]]]]:
    tools = [[{"role": "system", "content": TOOL_SYSTEM},
              {"role": "user", "content": f"What's the weather in {city} for the next {days} days, in {unit}"
               f"{', hour by hour' if hourly else ''}? Answer in English."}] for city, unit, days, hourly in CALLS]
    tests = [[{"role": "user", "content": f"utils.py:\n```python\n{MODULE}```\n\ntest_utils.py:\n```python\n{TESTS}```\n\n"
               f"Write the next test like these, for `{fn}`: one pytest function, three asserts, only the code."}]
             for fn in NEXT]
    return {"tools": tools, "tests": tests}


def _same(texts: list[str], plain: list[str]) -> str:
    """'True', or which answers differ from off's (index, first differing character). On a quantized
    model a batch of rows and one row give logits a few tenths apart (llama.cpp's kernels): a greedy
    answer can part at a near-tie, which RESULTS.md shows with the tie's margin."""
    differ = [f"{i}@{next((j for j, (a, b) in enumerate(zip(t, p)) if a != b), min(len(t), len(p)))}"
              for i, (t, p) in enumerate(zip(texts, plain)) if t != p]
    return "True" if not differ else "differs: " + " ".join(differ)


def run_ours(engine, prompts: list[list[int]], method: str, scope: str, tokens: int,
             fresh: list[int] | None = None, adaptive: bool = True) -> tuple[float, list[str], int, float | None]:
    """(decode tok/s of requests 2..n, every answer's text, tokens drafted from earlier answers,
    decode tok/s of the `fresh` prompt asked after them in the same scope)."""
    import edgeinfer

    texts, n_tok, secs, remembered = [], 0, 0.0, 0
    fresh_tok_s = None
    for i, p in enumerate(prompts + ([fresh] if fresh else [])):
        opts = edgeinfer.GenerateOptions(max_tokens=tokens, sampling=edgeinfer.SamplingOptions(temperature=0.0),
                                         speculation=edgeinfer.SpeculationOptions(method=method, memory_scope=scope,
                                                                                 adaptive=adaptive))
        done = engine.generate(p, opts).result()
        texts.append(done.text)
        if i == len(prompts):
            fresh_tok_s = done.stats.generated_tokens / done.stats.decode_s
        elif i:
            n_tok += done.stats.generated_tokens
            secs += done.stats.decode_s
            remembered += done.stats.speculation.remembered if done.stats.speculation else 0
    return n_tok / secs, texts, remembered, fresh_tok_s


def run_llama_lookup(target: str, texts: list[str], tokens: int, draft: int, threads: int) -> float:
    """llama-lookup over the sequence, one process per request, its -lcd cache file carried along."""
    tmp = Path(tempfile.mkdtemp(prefix="edgeinfer-lcd-"))
    cache = tmp / "dynamic.bin"
    n_tok, secs = 0, 0.0
    for i, text in enumerate(texts):
        prompt = tmp / f"prompt{i}.txt"
        prompt.write_text(text)
        cmd = [str(TOOLS / "llama-lookup"), "-m", target, "-f", str(prompt), "-n", str(tokens), "-t", str(threads),
               "-c", "4096", "--temp", "0", "--top-k", "1", "--spec-draft-n-max", str(draft), "-lcd", str(cache)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        m = DECODED.search(out.stdout + out.stderr)
        if out.returncode != 0 or not m:
            raise SystemExit(f"llama-lookup failed ({out.returncode}): {(out.stdout + out.stderr).strip()[-300:]}")
        if i:
            n_tok += int(m.group(1))
            secs += float(m.group(2))
    return n_tok / secs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sequences", default="tools,tests")
    ap.add_argument("--rows", default="off,suffix,auto,llama-lookup")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lookup-draft", type=int, default=8, help="llama-lookup's --spec-draft-n-max")
    ap.add_argument("--model", help="a GGUF file instead of the real 1.5B (e.g. the default model's)")
    ap.add_argument("--fresh", action="store_true", help="also time a fresh coding question after each sequence")
    ap.add_argument("--record", type=Path, help="replay_suffix's record file: the oracle row's cost curve")
    args = ap.parse_args()
    import edgeinfer
    from tests.real_models import qwen_pair

    target = args.model or str(qwen_pair()[0])
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if "llama-lookup" in rows and not (TOOLS / "llama-lookup").exists():
        raise SystemExit(f"llama.cpp tools not found in {TOOLS}: run benchmarks/build_llama_tools.sh")
    print(f"uptime at start: {os.popen('uptime').read().strip()}")
    with edgeinfer.load(target, n_ctx=4096, n_threads=args.threads, flash_attn=False) as engine:
        for name, seq in sequences().items():
            if name not in args.sequences.split(","):
                continue
            texts = [engine.render_chat(m) for m in seq]
            prompts = [engine.tokenize(t, add_special=False, parse_special=True) for t in texts]
            fresh = (engine.tokenize(engine.render_chat(FRESH), add_special=False, parse_special=True)
                     if args.fresh else None)
            oracle = None
            if "oracle" in rows:
                from benchmarks.oracle_drafter import OracleDrafts, plain_answers
                from benchmarks.replay_speculation import recorded_curve

                depth = round(statistics.median(len(p) for p in prompts), -2)
                curve = recorded_curve(engine, prompts[0], depth, 33, args.record)
                oracle = OracleDrafts(prompts, plain_answers(engine, prompts, args.tokens), curve)
                print(f"{name}: the oracle has a right draft at {oracle.right} positions of requests 2..n; its curve "
                      f"(rows: x one row) " + " ".join(f"{b}:{curve[b] / curve[1]:.2f}" for b in (2, 3, 4, 5, 8, 16, 32)))
            fresh_speeds: dict[str, list[float]] = {}
            speeds: dict[str, list[float]] = {}
            answers: dict[str, list[str]] = {}
            remembered: dict[str, list[int]] = {}
            for r in range(args.rounds):
                order = rows[r % len(rows):] + rows[: r % len(rows)]
                for row in order:
                    if row == "llama-lookup":
                        speeds.setdefault(row, []).append(run_llama_lookup(target, texts, args.tokens,
                                                                           args.lookup_draft, args.threads))
                        continue
                    # a scope per sequence, row and round: nothing remembered from another sequence's answers
                    if row == "oracle":
                        assert oracle is not None
                        with oracle.active():
                            tok_s, out, rem, fresh_s = run_ours(engine, prompts, "lookup", f"bench-{name}-{row}-{r}",
                                                                args.tokens, adaptive=False)
                    else:
                        tok_s, out, rem, fresh_s = run_ours(engine, prompts, row, f"bench-{name}-{row}-{r}",
                                                            args.tokens, fresh)
                    speeds.setdefault(row, []).append(tok_s)
                    if fresh_s is not None:
                        fresh_speeds.setdefault(row, []).append(fresh_s)
                    remembered.setdefault(row, []).append(rem)
                    if answers.setdefault(row, out) != out:
                        print(f"  {row}: answers differ between rounds")
            plain = statistics.median(speeds["off"]) if "off" in speeds else None
            print(f"\n{name}: {len(seq)} requests, {args.tokens} tokens max, greedy, {args.threads} threads, "
                  f"median of {args.rounds} alternating rounds; uptime {os.popen('uptime').read().strip()}")
            print("| row | decode tok/s, requests 2..n | × off | rounds | same text as off | remembered tokens |")
            print("| --- | ---: | ---: | --- | --- | ---: |")
            for row, v in speeds.items():
                med = statistics.median(v)
                same = "–" if row not in answers or "off" not in answers else _same(answers[row], answers["off"])
                print(f"| {row} | {med:.2f} | {med / plain:.2f} | {', '.join(f'{x:.2f}' for x in v)} | {same} | "
                      f"{statistics.median(remembered[row]) if row in remembered else '–'} |" if plain else
                      f"| {row} | {med:.2f} | – | {', '.join(f'{x:.2f}' for x in v)} | {same} | – |")
            if oracle is not None:
                print(f"oracle: {oracle.drafted} tokens drafted over {args.rounds} rounds")
            if fresh_speeds.get("off"):
                base = statistics.median(fresh_speeds["off"])
                print(f"\nfresh coding question after the sequence, same scope (decode tok/s; × off): " + ", ".join(
                    f"{row} {statistics.median(v):.2f} ({statistics.median(v) / base:.3f}; rounds "
                    f"{', '.join(f'{x:.2f}' for x in v)})" for row, v in fresh_speeds.items()))
            if "off" in answers:
                print("first answer (off):", answers["off"][0][:200].replace("\n", "\\n"))
                print("second answer (off):", answers["off"][1][:200].replace("\n", "\\n"))


if __name__ == "__main__":
    main()
