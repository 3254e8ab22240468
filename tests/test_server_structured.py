"""Structured output through `edgeinfer serve`, with the real `openai` client (what
tests/test_server_tools.py does not already cover):

- `client.chat.completions.parse(..., response_format=PydanticModel)` with a model that has a nested
  model, an enum, a bounded list, bounded numbers and an optional field (the client turns it into a
  strict schema: `$defs`/`$ref`, `anyOf` with null, `additionalProperties: false`) returns a parsed
  object, on the default model's F16 copy and on the real Qwen2.5-Coder-1.5B (marked `real`), where
  the values are also the ones the prompt's record gives.
- A schema with nested objects, arrays, enums, numbers with bounds, required and optional fields and
  `additionalProperties: false`: 52 seeded samples at T = 1, four requests at a time (they share the
  server's decode steps), every one ends by itself and validates (`jsonschema`, the independent
  checker); the samples differ and the optional fields are sometimes there, sometimes not.
- Bad constraints: a grammar whose every rule recurses without end, one with an undefined rule,
  schemas with keywords llguidance cannot enforce (`not`, `uniqueItems`), a schema of 1 MB (under
  the body limit, so it reaches the compiler), a grammar naming a special token, 1,000 nested
  parentheses: each is a 400 whose one-line message names the problem and whose `param` names the
  field, answered within a bounded time, while a streamed request runs on to its end beside them,
  and the server answers a constrained request afterwards. A recursive Pydantic model is enforced
  through `parse`; a grammar for a NUL byte is served (llguidance writes it with the byte token).

On the default model's F16 copy (test_server's MODEL_FILE link), with one llama.cpp thread per
server (EDGEINFER_THREADS, as the suite sets it per worker).
"""

from __future__ import annotations

import enum
import functools
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_batch_engine import f16_path  # noqa: F401  (the session fixture shared with the engine tests)
from test_server import MODEL_FILE, Server

pytestmark = pytest.mark.slow

BAD_REQUEST_S = 5.0  # a refused constraint is answered within this (compilation is bounded; measured < 0.3 s)


@pytest.fixture(scope="module")
def server(q4_path, tmp_path_factory) -> Iterator[Server]:
    # the shipped model as it is (Q4_1): no test here compares outputs across batch shapes, and at one
    # thread per worker it decodes 2.5x faster than the F16 copy (117 against 47 tok/s)
    s = Server(q4_path, tmp_path_factory.mktemp("serve-structured"), "--parallel", "4", "--ctx", "8192",
               "--max-tokens-limit", "512")
    yield s
    assert s.stop() == 0


# -- parse(PydanticModel) --------------------------------------------------------------------------

@functools.cache
def pydantic_models():
    """(Customer, Plan): made once, so that what `parse` returns is an instance of these classes."""
    from pydantic import BaseModel, Field

    class Plan(str, enum.Enum):
        basic = "basic"
        standard = "standard"
        premium = "premium"

    class Address(BaseModel):
        city: str = Field(max_length=20)
        country: str = Field(max_length=20)

    class Customer(BaseModel):
        name: str = Field(max_length=24)
        age: int = Field(ge=0, le=120)
        plan: Plan
        address: Address
        pets: list[str] = Field(max_length=3)
        rating: float = Field(ge=0, le=5)
        email: str | None = Field(max_length=40)  # the client's strict schema: anyOf [string, null]

    return Customer, Plan


RECORD = ("Customer record. Name: Alice Moreau. Age: 34. Plan: premium. Lives in Lyon, France. "
          "Pets: a cat and a dog. Satisfaction rating: 4 out of 5. No email address on file.")
ASK_RECORD = [{"role": "system", "content": "Extract the customer from the record as JSON."},
              {"role": "user", "content": RECORD}]


def parse_customer(client, max_tokens: int = 256):
    Customer, _ = pydantic_models()
    completion = client.chat.completions.parse(model=MODEL_FILE, messages=ASK_RECORD, response_format=Customer,
                                               max_tokens=max_tokens, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Customer)
    return choice.message.parsed


def test_parse_returns_a_nested_pydantic_object(server):
    """The client's strict schema (nested model and enum as $defs/$ref, Optional as anyOf with null,
    bounds, a bounded list) is compiled and enforced: the reply parses into the model."""
    _, Plan = pydantic_models()
    c = parse_customer(server.client())
    assert isinstance(c.plan, Plan) and 0 <= c.age <= 120 and 0 <= c.rating <= 5 and len(c.pets) <= 3
    print("\nthe default model's customer:", c.model_dump_json())


# qwen_server: the real 1.5B's server, shared with the other files that use it (tests/conftest.py)


@pytest.mark.real
def test_parse_on_the_real_qwen_gives_the_records_values(qwen_server):
    _, Plan = pydantic_models()
    c = parse_customer(qwen_server.client())
    print("\nQwen2.5-Coder-1.5B's customer:", c.model_dump_json())
    assert "Alice" in c.name and c.age == 34 and c.plan is Plan.premium
    assert c.address.city == "Lyon" and c.address.country == "France"
    assert c.rating == 4 and c.email is None


# -- a rich schema, many seeded samples at T = 1 -----------------------------------------------------

RICH = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "name", "status", "scores", "address"],
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "status": {"enum": ["active", "inactive", "banned"]},
        "rating": {"type": "number", "minimum": 0, "exclusiveMaximum": 5},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -10, "maximum": 100},
                   "minItems": 1, "maxItems": 3},
        "tags": {"type": "array", "items": {"enum": ["new", "vip", "late"]}, "maxItems": 2},
        "verified": {"type": "boolean"},
        "address": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city"],
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 10},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
        },
    },
}
OPTIONAL = ("rating", "tags", "verified")
SAMPLES = 52  # (the issue asks for at least 50)


def _counter(text: str, name: str) -> float:
    """A Prometheus counter summed over its samples (every label set)."""
    return sum(float(v) for v in re.findall(rf"^edgeinfer_{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def test_a_rich_schema_always_validates_over_52_seeded_samples_at_t1(server):
    import jsonschema

    client = server.client()
    before = server.metrics()
    messages = [{"role": "user", "content": "Invent a customer account as JSON."}]

    def sample(seed: int):
        r = client.chat.completions.create(model=MODEL_FILE, messages=messages, temperature=1.0, seed=seed,
                                           max_tokens=400, response_format={"type": "json_schema", "json_schema": {
                                               "name": "account", "schema": RICH, "strict": True}})
        return r.choices[0]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:  # four at a time: the server's four slots share each decode
        choices = list(pool.map(sample, range(SAMPLES)))
    seconds = time.perf_counter() - t0
    after = server.metrics()
    objects = []
    for seed, choice in enumerate(choices):
        assert choice.finish_reason == "stop", (seed, choice.message.content)  # every document ended by itself
        obj = json.loads(choice.message.content)
        jsonschema.validate(obj, RICH)
        objects.append(obj)
    seen = Counter(k for o in objects for k in OPTIONAL if k in o)
    distinct = len({json.dumps(o, sort_keys=True) for o in objects})
    print(f"\n{SAMPLES} samples in {seconds:.1f} s: {distinct} distinct; optional fields seen {dict(seen)}")
    assert distinct >= SAMPLES // 2  # seeded T = 1 sampling, not one document again and again
    for k in OPTIONAL:  # each optional field is reachable, and not forced
        assert 0 < seen[k] < SAMPLES, (k, seen)
    steps = _counter(after, "decode_steps_total") - _counter(before, "decode_steps_total")
    rows = _counter(after, "decode_rows_total") - _counter(before, "decode_rows_total")
    assert rows > 1.5 * steps, (rows, steps)  # requests shared decode steps


def test_seeded_constrained_samples_repeat(server):
    """The same seed gives the same constrained document (a T = 1 sample is the seed's, not noise)."""
    client = server.client()

    def once() -> str:
        return client.chat.completions.create(
            model=MODEL_FILE, messages=[{"role": "user", "content": "Invent a customer account as JSON."}],
            temperature=1.0, seed=12345, max_tokens=400,
            response_format={"type": "json_schema", "json_schema": {"name": "account", "schema": RICH}},
        ).choices[0].message.content

    assert once() == once()


# -- bad constraints: a clear 400, fast, and the server goes on ----------------------------------------

def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def _megabyte_schema() -> dict:
    """A JSON schema of about 1 MB (1,000,000 bytes serialized): under the server's 1 MiB body limit,
    so the schema compiler is what refuses it."""
    props = {f"field{i:05d}": {"type": "string", "description": "d" * 100} for i in range(5_000)}
    schema = {"type": "object", "properties": props}
    size = len(json.dumps(schema))
    pad = 1_000_000 - size
    assert pad > 0
    props["field00000"]["description"] += "d" * pad
    assert len(json.dumps(schema)) == 1_000_000
    return schema


BAD = {
    "grammar recursing without end": ({"grammar": 'root ::= item\nitem ::= "[" list\nlist ::= item "]"'},
                                      "grammar", r"matches no finite text"),
    "grammar with an undefined rule": ({"grammar": 'root ::= "a" missing'}, "grammar",
                                       r"invalid grammar: Rule 'missing' not found"),
    "keyword not": (_schema({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
                    "response_format", r'JSON schema: Unimplemented keys: \["not"\]'),
    "keyword uniqueItems": (_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
                            "response_format", r'Unimplemented keys: \["uniqueItems"\]'),
    "1 MB schema": (None, "response_format", r"JSON schema is too large: 1000000 bytes"),
    "a token named in a grammar": ({"grammar": 'root ::= "a" <|im_end|>'}, "grammar", r"grammar names a token"),
    "1,000 nested parentheses": ({"grammar": "root ::= " + "(" * 1000 + '"a"' + ")" * 1000}, "grammar",
                                 r"parentheses nested 33: at most 32"),
}


def _streamed_text(client, out: dict) -> None:
    stream = client.chat.completions.create(model=MODEL_FILE, stream=True, temperature=0, max_tokens=120,
                                            messages=[{"role": "user", "content": "Tell me about the sea."}])
    text, reason = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    out.update(text=text, reason=reason)


def test_bad_constraints_are_clear_400s_in_bounded_time_while_the_server_serves(server):
    import httpx2 as httpx  # the raw body: status, message and param as the client gets them

    client = server.client()
    streamed: dict = {}
    runner = threading.Thread(target=_streamed_text, args=(client, streamed))
    runner.start()  # a request streaming beside the bad ones
    try:
        for name, (fields, param, message) in BAD.items():
            fields = fields if fields is not None else _schema(_megabyte_schema())
            body = {"model": MODEL_FILE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields}
            t0 = time.perf_counter()
            r = httpx.post(server.url + "/chat/completions", json=body, timeout=60)
            seconds = time.perf_counter() - t0
            assert r.status_code == 400, (name, r.status_code, r.text[:300])
            error = r.json()["error"]
            assert re.search(message, error["message"]) and "\n" not in error["message"], (name, error)
            assert error["param"] == param and error["type"] == "invalid_request_error", (name, error)
            assert seconds < BAD_REQUEST_S, (name, seconds)
    finally:
        runner.join(120)
    assert streamed["reason"] in ("stop", "length") and len(streamed["text"]) > 20, streamed
    ok = client.chat.completions.create(model=MODEL_FILE, messages=[{"role": "user", "content": "Is fire hot?"}],
                                        temperature=0, max_tokens=8, extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert ok.choices[0].message.content in ("yes", "no")


def test_the_server_compiles_constraints_off_its_event_loop(f16_path, monkeypatch):  # noqa: F811
    """Parsing a request's schema or grammar and compiling it against the vocabulary cost time that
    grows with the constraint: the server does both in worker threads, never on its event loop
    (which every stream's bytes go through). The app served by uvicorn in this process, spied on."""
    import asyncio

    import httpx2 as httpx
    from test_server_slots import LiveApp

    import edgeinfer
    from edgeinfer.engine.core import sampler as sampler_module
    from edgeinfer.engine.structured import grammar as grammar_module
    from edgeinfer_server import ServerConfig

    def on_event_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    where: list[tuple[str, bool]] = []

    def spied(name, real):
        def call(*args, **kw):
            where.append((name, on_event_loop()))
            return real(*args, **kw)
        return call

    # llguidance: the grammar checked and compiled (grammar.py), the matcher made against the vocabulary
    monkeypatch.setattr(grammar_module, "llguidance_grammar", spied("compile", grammar_module.llguidance_grammar))
    monkeypatch.setattr(sampler_module, "Constraint", spied("matcher", sampler_module.Constraint))
    batch = edgeinfer.BatchOptions(parallel=1, calibrate_when_idle=False)
    with edgeinfer.BatchEngine.load(f16_path, batch=batch, n_ctx=1024) as engine:
        app = LiveApp(engine, ServerConfig(port=0))
        try:
            schema = {"type": "object", "properties": {"hot": {"type": "boolean"}}, "required": ["hot"],
                      "additionalProperties": False}
            for extra in ({"grammar": 'root ::= "yes" | "no" | "maybe"'},
                          {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}):
                body = {"messages": [{"role": "user", "content": "Is fire hot?"}], "max_tokens": 12, "temperature": 0,
                        **extra}
                r = httpx.post(app.url + "/v1/chat/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
        finally:
            app.stop()
    assert {name for name, _ in where} == {"compile", "matcher"}, where
    assert not [w for w in where if w[1]], where


def test_a_recursive_pydantic_model_is_enforced_through_parse(server):
    """llguidance enforces recursive schemas ($ref to itself): `parse` gets a tree back."""
    from pydantic import BaseModel, Field

    class Node(BaseModel):
        name: str = Field(max_length=8)
        children: list[Node] = Field(max_length=2)

    Node.model_rebuild()
    r = server.client().chat.completions.parse(
        model=MODEL_FILE, messages=[{"role": "user", "content": "A tree of three nodes as JSON."}],
        response_format=Node, max_tokens=400, temperature=1.0, seed=3)
    assert isinstance(r.choices[0].message.parsed, Node)


def test_a_grammar_for_a_byte_no_text_token_writes_is_served(server):
    """`root ::= "\x00"`: llama.cpp's grammar sampler found no token for a NUL (a 400 before);
    llguidance writes it with the byte token, streamed or not."""
    import httpx2 as httpx

    body = {"model": MODEL_FILE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "grammar": 'root ::= "\\x00"'}
    r = httpx.post(server.url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "\x00", r.text[:300]
    r = httpx.post(server.url + "/chat/completions", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200 and "\\u0000" in r.text, r.text[:300]
