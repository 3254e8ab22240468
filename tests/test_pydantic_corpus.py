"""Every schema Pydantic v2 emits for the ordinary models of tests/pydantic_corpus.py (34 models:
tuples, Literal, enums, discriminated and plain unions, patterns, lengths, formats, Optional,
dict[str, X], nested and recursive models, numeric bounds, multipleOf) is accepted, and what
llguidance cannot enforce (`set[str]`: uniqueItems) is refused in one line naming the keyword.

Sampled (slow tier): 50 seeded samples per model at T = 1 on the default model's F16 copy, eight
requests at a time on one BatchEngine (they share decode steps), each validated by `jsonschema` (the
independent checker) and by the Pydantic model itself. 50 per model is the issue's count; 34 × 50
= 1,700 short documents is what keeps this test near a minute on the 135M model with 8 slots.
"""

from __future__ import annotations

import json

import pytest
from pydantic_corpus import CORPUS, REFUSED
from test_batch_engine import f16_path  # noqa: F401  (the session fixture shared with the engine tests)

from edgeinfer import GenerateOptions, InvalidOptionError, SamplingOptions

SAMPLES = 50


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


@pytest.mark.slow
def test_fifty_seeded_samples_per_model_validate(f16_path):  # noqa: F811
    import jsonschema
    from concurrent.futures import ThreadPoolExecutor

    from edgeinfer import BatchEngine, BatchOptions

    with BatchEngine.load(f16_path, batch=BatchOptions(parallel=8, calibrate_when_idle=False), n_ctx=8192,
                          flash_attn=False) as be:
        def sample(job):
            model, seed = job
            schema = model.model_json_schema()
            prompt = be.tokenize(f"A {model.__name__} as JSON: ")
            opts = GenerateOptions(max_tokens=400, json_schema=schema,
                                   sampling=SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
            return model, seed, be.submit(prompt, opts).result()

        jobs = [(m, s) for m in CORPUS for s in range(SAMPLES)]
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(sample, jobs))
    for model, seed, done in results:
        assert done.finish_reason == "stop", (model.__name__, seed, done.text[-200:])
        jsonschema.validate(json.loads(done.text), model.model_json_schema())
        model.model_validate_json(done.text)
