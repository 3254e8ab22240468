"""Every schema Pydantic v2 emits for the ordinary models of tests/pydantic_corpus.py (34 models:
tuples, Literal, enums, discriminated and plain unions, patterns, lengths, formats, Optional,
dict[str, X], nested and recursive models, numeric bounds, multipleOf) is accepted, and what
llguidance cannot enforce (`set[str]`: uniqueItems) is refused in one line naming the keyword.

Sampled (slow tier): seeded samples per model at T = 1 (the default top-k/top-p/min-p) on the
default model's F16 copy, eight requests at a time on one BatchEngine (they share decode steps);
every sample that ends is validated by `jsonschema` (the independent checker) and by the Pydantic
model itself (except where the schema Pydantic emits is looser than the model: `_schema_is_looser`,
listed and counted). The suite draws one per model (34 documents); the issue's 50 per model (1,700)
run with EDGEINFER_CORPUS_SAMPLES=50 (benchmarks/RESULTS.md has that run). A 135M model at T = 1
sometimes runs on inside a string or a number's digits until max_tokens (measured: 17 of 340,
all in free strings and fractions, which JSON Schema leaves unbounded); such a sample is cut, not
invalid, and at most 1 in 8 may be.
"""

from __future__ import annotations

import json
import os

import pytest
from pydantic_corpus import CORPUS, REFUSED
from test_batch_engine import f16_path  # noqa: F401  (the session fixture shared with the engine tests)

from edgeinfer import GenerateOptions, InvalidOptionError, SamplingOptions

SAMPLES = int(os.environ.get("EDGEINFER_CORPUS_SAMPLES", "1"))
MAX_TOKENS = 192  # the longest sample that ended in 340 took 80 tokens


def test_the_corpus_covers_what_pydantic_emits():
    assert len(CORPUS) >= 30
    text = json.dumps([m.model_json_schema() for m in CORPUS])
    for keyword in ('"prefixItems"', '"oneOf"', '"anyOf"', '"const"', '"discriminator"', '"pattern"',
                    '"minLength"', '"maxLength"', '"format": "date-time"', '"format": "uuid"', '"$ref"', '"$defs"',
                    '"additionalProperties"', '"enum"', '"multipleOf"', '"exclusiveMinimum"', '"maxItems"'):
        assert keyword in text, keyword


@pytest.mark.parametrize("model", CORPUS, ids=lambda m: m.__name__)
def test_every_corpus_schema_is_accepted(model):
    GenerateOptions(json_schema=model.model_json_schema()).validate()


@pytest.mark.parametrize("model, keyword", REFUSED, ids=lambda v: getattr(v, "__name__", v))
def test_what_cannot_be_enforced_is_refused_naming_the_keyword(model, keyword):
    with pytest.raises(InvalidOptionError, match=keyword) as e:
        GenerateOptions(json_schema=model.model_json_schema()).validate()
    assert "\n" not in str(e.value)


def test_open_ends_get_practical_defaults_and_still_validate():
    """Objects with properties allow only those (unless the schema says otherwise); integers without a
    bound get 16 digits at most; values inside const/enum/default are data and stay as they are."""
    import jsonschema

    from edgeinfer.engine.structured.llg import with_practical_defaults

    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "low": {"type": "integer", "minimum": 3},
        "any": {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
        "tag": {"const": {"properties": {"x": 1}}}, "list": {"type": "array", "items": {"properties": {"y": {}}}}}}
    out = with_practical_defaults(schema)
    assert out["additionalProperties"] is False and "additionalProperties" not in schema  # a copy
    assert out["properties"]["n"] == {"type": "integer", "minimum": -(10**16 - 1), "maximum": 10**16 - 1}
    assert out["properties"]["low"] == {"type": "integer", "minimum": 3, "maximum": 10**16 - 1}
    assert out["properties"]["any"]["additionalProperties"] is True
    assert out["properties"]["tag"] == {"const": {"properties": {"x": 1}}}
    assert out["properties"]["list"]["items"]["additionalProperties"] is False
    document = {"n": 10**16 - 1, "low": 3, "any": {"a": "x", "b": 2}, "tag": {"properties": {"x": 1}}, "list": [{"y": 1}]}
    jsonschema.validate(document, out)
    jsonschema.validate(document, schema)  # what the defaults allow, the schema allowed
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**document, "extra": 1}, out)


def _schema_is_looser(error: dict) -> bool:
    """Where Pydantic's model refuses what the JSON schema it emits allows (so no constrained sampler
    can know): RFC 3339's full-date has a year 0000, Python's date has not; a Decimal's schema is
    `anyOf: [number, string]` without its max_digits/decimal_places, any string or number, which
    the model then parses and bounds (decimal_parsing, decimal_whole_digits, decimal_max_places, …)."""
    return (error["type"] == "date_parsing" and "year 0" in error["msg"]) or error["type"].startswith("decimal_")


@pytest.mark.slow
def test_seeded_samples_per_model_validate(f16_path):  # noqa: F811
    import jsonschema
    import pydantic
    from concurrent.futures import ThreadPoolExecutor

    from edgeinfer import BatchEngine, BatchOptions

    with BatchEngine.load(f16_path, batch=BatchOptions(parallel=8, calibrate_when_idle=False), n_ctx=8192,
                          flash_attn=False) as be:
        def sample(job):
            model, seed = job
            schema = model.model_json_schema()
            prompt = be.tokenize(f"A {model.__name__} as JSON: ")
            opts = GenerateOptions(max_tokens=MAX_TOKENS, json_schema=schema,
                                   sampling=SamplingOptions(temperature=1.0, seed=seed))
            return model, seed, be.submit(prompt, opts).result()

        jobs = [(m, s) for m in CORPUS for s in range(SAMPLES)]
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(sample, jobs))
    looser: list[tuple[str, int, str]] = []
    cut = [(model.__name__, seed) for model, seed, done in results if done.finish_reason == "length"]
    assert len(cut) <= len(results) // 8, cut
    for model, seed, done in results:
        if done.finish_reason == "length":
            continue
        assert done.finish_reason in ("eos", "stop"), (model.__name__, seed, done.finish_reason)
        jsonschema.validate(json.loads(done.text), model.model_json_schema())
        try:
            model.model_validate_json(done.text)
        except pydantic.ValidationError as e:
            if not all(_schema_is_looser(error) for error in e.errors()):
                raise
            looser.append((model.__name__, seed, done.text))
    print(f"{len(looser)} valid by the schema Pydantic emits and refused by its model: {looser}")
    print(f"{len(results)} samples, {len(results) - len(cut)} ended and validated, {len(cut)} cut at {MAX_TOKENS} tokens")
