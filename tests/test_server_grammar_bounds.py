"""Issue 45's grammar bombs and a seeded fuzz campaign, through the real HTTP server.

The server is `edgeinfer serve` in a child process (tests/test_server.py's Server), so a crash
(the SIGSEGV a 40 KB grammar once caused) fails the test instead of the suite. Each bomb is a 400
whose one-line message names the limit (engine/structured/bounds.py) — or, for a grammar within
the bounds, a 200 whose text the grammar matches — while a thread polls /health: its slowest answer
must stay under HEALTH_STALL_S. The issue's target is 100 ms; the bound here is 10× that because
this 2-core machine is shared with several other test runs (load average ~10 when measured), where
even an idle server's /health takes tens of ms; a grammar compiled on the event loop stalled it
for seconds to minutes before. Then an ordinary request gets a 200 and the process is alive.

The fuzz campaign: random GBNF grammars (nesting, alternation, repetition counts, recursion,
undefined rules, token references, long literals) and JSON schemas (nesting, unions, huge enums,
long strings, patterns, recursive $refs, prefixItems, numeric bounds), seeded; each request must
be a 200 or a 400 — never a 5xx, a hang (60 s timeout) or a dead server. FUZZ_COUNT in the suite;
`EDGEINFER_FUZZ_MORE=N` adds N more (the long campaign). The slowest answer is printed.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from collections.abc import Iterator

import pytest
from test_batch_engine import f16_path  # noqa: F401  (the session fixture shared with the engine tests)
from test_server import MODEL_FILE, Server

pytestmark = pytest.mark.slow

HEALTH_STALL_S = 1.0  # see the module docstring: 10× the 100 ms, for a shared 2-core machine
FUZZ_COUNT = 24
FUZZ_MORE = int(os.environ.get("EDGEINFER_FUZZ_MORE", "0") or 0)


@pytest.fixture(scope="module")
def server(f16_path, tmp_path_factory) -> Iterator[Server]:  # noqa: F811
    s = Server(f16_path, tmp_path_factory.mktemp("serve-bounds"), "--parallel", "2", "--ctx", "2048",
               "--max-tokens-limit", "64")
    yield s
    assert s.stop() == 0


class HealthWatch:
    """Polls /health in a thread while the block runs; `slowest` is its longest answer."""

    def __init__(self, url: str):
        self.url = url.removesuffix("/v1") + "/health"
        self.slowest = 0.0
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx2 as httpx

        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                r = client.get(self.url)
                self.slowest = max(self.slowest, time.perf_counter() - t0)
                assert r.status_code == 200
                self.answers += 1
                self._stop.wait(0.02)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def _chat(server: Server, extra: dict, *, max_tokens: int = 8, seed: int = 0, timeout: float = 60):
    import httpx2 as httpx

    body = {"model": MODEL_FILE, "messages": [{"role": "user", "content": "Answer."}], "max_tokens": max_tokens,
            "temperature": 1.0, "seed": seed, **extra}
    return httpx.post(server.url + "/chat/completions", json=body, timeout=timeout)


BOMBS = {
    "40 KB of nested parentheses": ("root ::= " + "(" * 20000 + '"a"' + ")" * 20000, r"parentheses nested 33: at most 32"),
    "1,000 identical alternatives, repeated": ("root ::= (" + " | ".join(['"a"'] * 1000) + ")+",
                                               r"more than 128 alternatives in one group"),
    "a 5,000-rule chain": ("root ::= r0\n" + "\n".join(f'r{i} ::= "x" r{i + 1}' for i in range(5000)) + '\nr5000 ::= "y"',
                           r"too large: \d+ bytes \(at most 65536\)"),
    "a 2,000-rule chain, compact": ("root::=a0\n" + "\n".join(f"a{i}::=a{i + 1}" for i in range(2000)) + '\na2000::="y"',
                                    r"grammar has rules 257: at most 256"),
    "a special token named": ('root ::= "a" <|im_end|>', r"grammar names a token \(<\|im_end\|>\)"),
    "1,000 nested parentheses": ("root ::= " + "(" * 1000 + '"a"' + ")" * 1000, r"parentheses nested 33"),
}


def test_grammar_bombs_are_400s_naming_the_limit_while_health_answers(server):
    with HealthWatch(server.url) as health:
        for name, (gbnf, message) in BOMBS.items():
            r = _chat(server, {"grammar": gbnf})
            assert r.status_code == 400, (name, r.status_code, r.text[:300])
            error = r.json()["error"]
            assert re.search(message, error["message"]) and "\n" not in error["message"], (name, error)
            assert error["param"] == "grammar", (name, error)
        # within the bounds: served, and the text is what the grammar allows
        r = _chat(server, {"grammar": "root ::= (" + " | ".join(['"a"'] * 128) + ")+"}, max_tokens=12)
        assert r.status_code == 200, r.text[:300]
        assert re.fullmatch("a+", r.json()["choices"][0]["message"]["content"]), r.text[:300]
    assert server.proc.poll() is None
    assert health.answers > 0 and health.slowest < HEALTH_STALL_S, (health.answers, health.slowest)
    r = _chat(server, {}, max_tokens=4)
    assert r.status_code == 200, r.text[:300]


# -- the fuzz campaign ------------------------------------------------------------------------------

_CHARS = 'ab"\\xyz 0{}[]()|*+?.-\n\t'


def _literal(rng: random.Random) -> str:
    text = "".join(rng.choice(_CHARS) for _ in range(rng.choice((1, 2, 5, 40, 300))))
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'


def _gbnf_expr(rng: random.Random, rules: int, depth: int, budget: list[int]) -> str:
    """A random expression; `budget` (atoms left) keeps the text to tens of KB at most."""
    budget[0] -= 1
    roll = rng.random()
    if depth <= 0 or budget[0] <= 0 or roll < 0.3:
        atom = rng.choice([_literal(rng), "[a-z]", "[^\\n]", "[0-9]", f"r{rng.randrange(rules + 1)}",
                           "<|im_end|>" if rng.random() < 0.03 else '"q"'])
    elif roll < 0.55:
        n = rng.choice((2, 3, 20, 300))
        atom = "(" + " | ".join(_gbnf_expr(rng, rules, depth - 1, budget) for _ in range(n)) + ")"
    elif roll < 0.8:
        atom = "(" + " ".join(_gbnf_expr(rng, rules, depth - 1, budget) for _ in range(rng.randint(1, 4))) + ")"
    elif rng.random() < 0.2:
        atom = "(" * 40 + _gbnf_expr(rng, rules, 0, budget) + ")" * 40
    else:
        atom = "(" + _gbnf_expr(rng, rules, depth - 1, budget) + ")"
    return atom + rng.choice(["", "", "*", "+", "?", "{2}", "{0,3}", "{1,2500}", "{3,}"])


def random_gbnf(rng: random.Random) -> str:
    n = rng.choice((1, 3, 10, 300))
    budget = [rng.choice((5, 50, 400, 3000))]
    body = [f"r{i} ::= {_gbnf_expr(rng, n, rng.randint(0, 6), budget)}" for i in range(n)]
    return f"root ::= {_gbnf_expr(rng, n, 3, budget)}\n" + "\n".join(body)


def _schema(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "object", "array", "enum", "anyOf", "oneOf", "ref",
                       "tuple", "null"] if depth > 0 else ["string", "integer", "number", "boolean", "enum", "null"])
    if kind == "string":
        out: dict = {"type": "string"}
        if rng.random() < 0.4:
            out["maxLength"] = rng.choice((1, 5, 100, 5000))
        if rng.random() < 0.3:
            out["pattern"] = rng.choice(["^[a-z]+$", "^(a|b)*c{2,5}$", "^[0-9]{3}-[A-Z]{2}$", "(((x)*)*)*y", "^.{0,40}$"])
        if rng.random() < 0.2:
            out["format"] = rng.choice(["date-time", "date", "uuid", "email", "hostname", "unknown-format"])
        return out
    if kind in ("integer", "number"):
        out = {"type": kind}
        if rng.random() < 0.5:
            out["minimum"] = rng.choice((-10**12, 0, 3, 7.5))
        if rng.random() < 0.5:
            out["maximum"] = rng.choice((10, 10**15, 99.5))
        if rng.random() < 0.3:
            out["multipleOf"] = rng.choice((2, 5, 0.25, 7))
        return out
    if kind == "boolean" or kind == "null":
        return {"type": kind}
    if kind == "enum":
        n = rng.choice((1, 3, 50, 3000))
        return {"enum": [("v" * rng.randint(1, 30)) + str(i) for i in range(n)]}
    if kind == "object":
        n = rng.choice((1, 3, 8, 60)) if depth > 2 else rng.choice((1, 3, 8))  # (bounded: 8 levels of 60 would not be)
        props = {f"k{i}_{'p' * rng.randint(0, 20)}": _schema(rng, depth - 1) for i in range(n)}
        out = {"type": "object", "properties": props, "required": [k for k in props if rng.random() < 0.7]}
        out["additionalProperties"] = rng.choice([False, True, {"type": "integer"}])
        return out
    if kind == "array":
        out = {"type": "array", "items": _schema(rng, depth - 1)}
        if rng.random() < 0.5:
            out["maxItems"] = rng.choice((0, 2, 10, 4000))
        return out
    if kind == "tuple":
        return {"type": "array", "prefixItems": [_schema(rng, depth - 1) for _ in range(rng.randint(1, 4))],
                "items": False}
    if kind == "ref":
        return {"$ref": "#"}  # the whole schema again: recursion
    return {kind: [_schema(rng, depth - 1) for _ in range(rng.choice((2, 3, 30)) if depth <= 2 else 2)]}


def random_schema(rng: random.Random) -> dict:
    """A random schema of at most 512 KB (larger bodies are the body limit's, not the compiler's)."""
    schema = _schema(rng, rng.choice((1, 2, 4, 8)))
    while len(json.dumps(schema)) > 512 << 10:
        schema = _schema(rng, 2)
    if rng.random() < 0.1:  # deep nesting
        for _ in range(rng.choice((20, 40, 200))):
            schema = {"type": "array", "items": schema}
    return schema


def test_a_seeded_fuzz_campaign_gets_no_5xx_no_hang_no_crash(server):
    rng = random.Random(45)
    count = FUZZ_COUNT + FUZZ_MORE
    statuses: dict[int, int] = {}
    slowest = (0.0, "")
    with HealthWatch(server.url) as health:
        for i in range(count):
            if i % 2:
                extra = {"grammar": random_gbnf(rng)}
            else:
                extra = {"response_format": {"type": "json_schema",
                                             "json_schema": {"name": "f", "schema": random_schema(rng)}}}
            t0 = time.perf_counter()
            r = _chat(server, extra, max_tokens=16, seed=i)
            seconds = time.perf_counter() - t0
            if seconds > slowest[0]:
                slowest = (seconds, json.dumps(extra)[:200])
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400), (i, r.status_code, r.text[:300], json.dumps(extra)[:300])
            if r.status_code == 400:
                message = r.json()["error"]["message"]
                assert "\n" not in message and len(message) < 400, message
            assert server.proc.poll() is None, i
    print(f"\nfuzz: {count} requests, statuses {statuses}, slowest {slowest[0]:.2f} s ({slowest[1]}); "
          f"/health slowest {health.slowest * 1000:.0f} ms over {health.answers} answers")
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0  # both kinds were generated
    assert health.slowest < HEALTH_STALL_S, health.slowest
