"""Structured output: what the grammar costs, and what prompt lookup buys on JSON extraction.

Two parts (both by default; `--part cost` or `--part extract` for one):

- cost: on an Engine (one slot), the same JSON-extraction prompts decoded free and under the JSON
  schema, greedy and sampled (T = 0.7, seeded), speculation off: per-request decode tok/s (prefill
  excluded), median over prompts and rounds, and the constrained/free ratio measured in the same
  rounds (rows alternate, their order rotates between rounds). That ratio is the grammar's cost.
- extract: `edgeinfer serve` with speculation off and with prompt lookup (one server each, as
  bench_serve.py starts them), beside `llama-server` (built by benchmarks/build_llama_tools.sh),
  every request a streamed greedy chat with the same `response_format` json_schema and the same
  prompt (a document, a schema to fill from it). For each concurrency level the clients send at
  once; rows alternate and rotate; medians over rounds of total tok/s, TTFT and per-request decode
  tok/s, with ratios to llama-server, and how many replies validate (jsonschema).

The machine is shared: read the ratios (measured in the same rounds), not the absolute numbers.

    .venv/bin/python benchmarks/bench_structured.py [--model PATH|REF] [--part cost,extract] [--rounds 3]
        [--prompts 4] [--tokens 256] [--concurrency 1,4] [--parallel 4] [--ctx 8192] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package ships with

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import TOOLS, Servers, model_file, model_id  # noqa: E402  (the servers, started as bench_serve starts them)

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["order_id", "customer", "email", "city", "items", "total", "status"],
    "properties": {
        "order_id": {"type": "string", "maxLength": 16},
        "customer": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60},
        "city": {"type": "string", "maxLength": 30},
        "items": {"type": "array", "maxItems": 6, "items": {
            "type": "object", "additionalProperties": False, "required": ["product", "quantity", "unit_price"],
            "properties": {"product": {"type": "string", "maxLength": 40},
                           "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                           "unit_price": {"type": "number", "minimum": 0, "maximum": 10000}}}},
        "total": {"type": "number", "minimum": 0, "maximum": 100000},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
    },
}
PEOPLE = [("Alice Moreau", "Lyon"), ("Bruno Silva", "Porto"), ("Chen Wei", "Shanghai"), ("Dana Novak", "Prague"),
          ("Erik Larsen", "Bergen"), ("Fatima Zahra", "Rabat"), ("Giulia Conti", "Bologna"), ("Hiro Tanaka", "Osaka")]
PRODUCTS = [("stainless steel water bottle", 18.5), ("wireless ergonomic mouse", 34.0), ("USB-C charging cable", 9.99),
            ("mechanical keyboard with brown switches", 89.0), ("27 inch monitor stand", 45.25),
            ("noise cancelling headphones", 129.0), ("laptop sleeve, 14 inch, grey", 22.0), ("desk lamp with dimmer", 39.9)]
STATUSES = ["pending", "shipped", "delivered", "cancelled"]


def document(i: int) -> tuple[str, str]:
    """(the prompt, the order id): an order confirmation email in prose, its facts repeated as such
    emails do; the reply copies names, products and numbers from it."""
    name, city = PEOPLE[i % len(PEOPLE)]
    items = [PRODUCTS[(i + k) % len(PRODUCTS)] for k in range(2 + i % 3)]
    qty = [1 + (i + k) % 4 for k in range(len(items))]
    total = round(sum(q * p for q, (_, p) in zip(qty, items)), 2)
    order = f"A{1000 + 37 * i}"
    email = name.lower().replace(" ", ".") + "@example.com"
    status = STATUSES[i % len(STATUSES)]
    lines = "\n".join(f"- {q} x {p} at {price:.2f} EUR each" for q, (p, price) in zip(qty, items))
    doc = (f"Subject: Your order {order} is {status}\n\nDear {name},\n\nthank you for your order {order}. We are writing "
           f"to confirm the details. The order was placed by {name} ({email}) for delivery to {city}.\n\nItems "
           f"ordered:\n{lines}\n\nOrder total: {total:.2f} EUR. Current status: {status}. If anything in order {order} "
           f"is wrong, reply to this email and quote the order number.\n\nBest regards,\nThe shop in {city}")
    ask = ("Extract the order from this email as JSON: order_id, customer, email, city, items (product, quantity, "
           "unit_price), total, status.")
    return f"{ask}\n\n{doc}", order


# -- cost: the grammar's per-token price on an Engine ---------------------------------------------------

def run_cost(args: argparse.Namespace, model: str) -> None:
    import edgeinfer
    from edgeinfer import GenerateOptions, SamplingOptions

    rows = {
        "free, greedy": (None, SamplingOptions(temperature=0.0)),
        "schema, greedy": (SCHEMA, SamplingOptions(temperature=0.0)),
        "free, T=0.7": (None, SamplingOptions(temperature=0.7, seed=1)),
        "schema, T=0.7": (SCHEMA, SamplingOptions(temperature=0.7, seed=1)),
    }
    samples: dict[str, list[float]] = {r: [] for r in rows}
    tokens: dict[str, list[int]] = {r: [] for r in rows}
    cut: dict[str, int] = {r: 0 for r in rows}  # replies that reached max_tokens
    loads: list[float] = []
    with edgeinfer.load(model, n_ctx=4096, n_threads=args.threads) as engine:
        engine.chat([{"role": "user", "content": "warm up"}], GenerateOptions(max_tokens=8)).result()
        for rnd in range(args.rounds):
            names = list(rows)
            names = names[rnd % len(names):] + names[: rnd % len(names)]
            for i in range(args.prompts):
                text, _ = document(i)
                for name in names:
                    schema, sampling = rows[name]
                    engine.reset()  # every row reads the prompt afresh: decode rates, not cache luck
                    loads.append(os.getloadavg()[0])
                    done = engine.chat([{"role": "user", "content": text}],
                                       GenerateOptions(max_tokens=args.tokens, json_schema=schema, sampling=sampling)).result()
                    if schema is not None and done.finish_reason != "length":
                        json.loads(done.text)  # a constrained reply that ended by itself parses
                    cut[name] += done.finish_reason == "length"
                    samples[name].append(done.stats.decode_tok_s)
                    tokens[name].append(done.stats.generated_tokens)
                    print(f"round {rnd + 1} prompt {i} {name}: {done.stats.generated_tokens} tokens, "
                          f"{done.stats.decode_tok_s:.1f} tok/s", file=sys.stderr)
    print(f"\nthe grammar's cost: {Path(model).name}, Engine, {args.threads} threads, speculation off, "
          f"{args.prompts} prompts x {args.rounds} rounds (median); load average {min(loads):.1f}-{max(loads):.1f}\n")
    print("| row | decode tok/s | × free (same sampling) | tokens per reply | cut by max_tokens |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in rows:
        med = statistics.median(samples[name])
        free = statistics.median(samples[name.replace("schema", "free")])
        print(f"| {name} | {med:.1f} | {med / free:.2f}× | {statistics.median(tokens[name]):.0f} | "
              f"{cut[name]}/{len(samples[name])} |")


# -- extract: lookup on a JSON-extraction workload, beside llama-server --------------------------------

def extract_request(url: str, model: str, prompt: str, tokens: int, extra: dict, out: dict) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA,
                                                                       "strict": True}}, **extra}
    t0 = time.perf_counter()
    first = last = None
    text, usage, spec = [], None, {}
    with httpx.Client(timeout=900) as http, http.stream("POST", url + "/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            spec = (chunk.get("edgeinfer") or {}).get("speculation") or spec
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    last = time.perf_counter()
                    first = first or last
                    text.append(piece)
    n = usage["completion_tokens"] if usage else len(text)
    out.update(text="".join(text), tokens=n, ttft=(first or t0) - t0, end=time.perf_counter(),
               decode=(n - 1) / (last - first) if first and last and last > first else 0.0,
               drafted=spec.get("drafted", 0), accepted=spec.get("accepted", 0))


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def extract_round(url: str, model: str, prompts: list[str], tokens: int, extra: dict) -> dict:
    results = [dict() for _ in prompts]
    barrier = threading.Barrier(len(prompts))

    def client(i: int) -> None:
        barrier.wait()
        extract_request(url, model, prompts[i], tokens, extra, results[i])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["end"] for r in results) - t0
    return {"throughput": sum(r["tokens"] for r in results) / wall, "ttft": statistics.median(r["ttft"] for r in results),
            "decode": statistics.median(r["decode"] for r in results), "tokens": sum(r["tokens"] for r in results),
            "valid": sum(valid(r["text"]) for r in results), "n": len(results),
            "drafted": sum(r["drafted"] for r in results), "accepted": sum(r["accepted"] for r in results)}


def run_extract(args: argparse.Namespace, model: str, env: dict) -> None:
    servers = Servers(argparse.Namespace(parallel=args.parallel, ctx=args.ctx, threads=args.threads,
                                         no_llama_server=args.no_llama_server), model, env)
    try:
        rows: dict[str, tuple[str, str, dict]] = {}
        for row, speculate in (("edgeinfer off", "off"), ("edgeinfer lookup", "lookup")):
            _, url = servers.ours_for(speculate)
            rows[row] = (url, model_id(url), {"speculation": speculate})
        peer = servers.llama_server()
        if peer is not None:
            rows[f"llama-server -np {args.parallel}"] = (peer, model_id(peer), {})
        else:
            print(f"(no llama-server at {TOOLS / 'bin'}: run benchmarks/build_llama_tools.sh for that row)",
                  file=sys.stderr)
        levels = [int(c) for c in args.concurrency.split(",")]
        samples: dict[tuple[str, int], list[dict]] = {}
        loads: list[float] = []
        for url, mid, extra in rows.values():  # warm-up: page faults, the grammar cache
            extract_round(url, mid, [document(0)[0]], 8, extra)
        for rnd in range(args.rounds):
            for c in levels:
                names = list(rows)
                names = names[rnd % len(names):] + names[: rnd % len(names)]
                for name in names:
                    url, mid, extra = rows[name]
                    # a different document per client and round: no reply is served from a cached prompt
                    texts = [document(rnd * 8 + k)[0] + f"\n\n(request {rnd}-{c}-{k}, {name})" for k in range(c)]
                    loads.append(os.getloadavg()[0])
                    sample = extract_round(url, mid, texts, args.tokens, extra)
                    samples.setdefault((name, c), []).append(sample)
                    print(f"round {rnd + 1} c={c} {name}: {sample}", file=sys.stderr)
    finally:
        servers.stop()
    ref = next((r for r in rows if r.startswith("llama-server")), "edgeinfer off")
    print(f"\nJSON extraction: {Path(model).name}, greedy, response_format json_schema, up to {args.tokens} tokens, "
          f"{args.parallel} slots, --ctx {args.ctx}, {args.threads} threads, median of {args.rounds} rounds; load "
          f"average {min(loads):.1f}-{max(loads):.1f}\n")
    print(f"| server | clients | total tok/s | × {ref} | TTFT s | per-request decode tok/s | × {ref} | "
          "drafted per token | accepted | valid |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in levels:
        base = samples[(ref, c)]
        base_thr = statistics.median(s["throughput"] for s in base)
        base_dec = statistics.median(s["decode"] for s in base)
        for name in rows:
            got = samples[(name, c)]
            thr = statistics.median(s["throughput"] for s in got)
            dec = statistics.median(s["decode"] for s in got)
            drafted = sum(s["drafted"] for s in got)
            drafting = (f"{drafted / sum(s['tokens'] for s in got):.2f} | {sum(s['accepted'] for s in got) / drafted:.0%}"
                        if drafted else "- | -")
            print(f"| {name} | {c} | {thr:.2f} | {thr / base_thr:.2f}× | {statistics.median(s['ttft'] for s in got):.2f} "
                  f"| {dec:.2f} | {dec / base_dec:.2f}× | {drafting} | {sum(s['valid'] for s in got)}/"
                  f"{sum(s['n'] for s in got)} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="store ref or .gguf (default: an F16 copy of the default model)")
    ap.add_argument("--part", default="cost,extract", help="cost, extract (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="cost: prompts per round")
    ap.add_argument("--tokens", type=int, default=256, help="max_tokens (the schema's replies end before it)")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=8192, help="whole context, split between the slots")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama-server", action="store_true")
    args = ap.parse_args()
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background by a shell
        signal.signal(signal.SIGINT, signal.default_int_handler)
    home = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    env = dict(os.environ, EDGEINFER_HOME=str(home))
    model = model_file(args.model, home)
    parts = args.part.split(",")
    if "cost" in parts:
        run_cost(args, model)
    if "extract" in parts:
        run_extract(args, model, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
