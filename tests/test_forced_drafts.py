"""Forced tokens as drafts (issue 46): under a llguidance grammar the sampler reports the tokens the
grammar forces (`Sampler.forced`), and `--speculate lookup` drafts them first; the output is plain
decoding's token for token, greedy and at T = 1 with a fixed seed (verification samples every row
from the constrained distribution, whose only token a forced row's is), and forced rows are never
rejected. On the default model (one Engine shared by the module)."""

from __future__ import annotations

import pytest

import edgeinfer
from edgeinfer import GenerateOptions, SamplingOptions, SpeculationOptions
from edgeinfer.engine.core.sampler import Sampler

pytestmark = pytest.mark.slow  # (the tokenizer llguidance builds costs seconds; the runs tens)

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["customer_name", "shipping_city", "number_of_items", "is_gift_wrapped"],
          "properties": {"customer_name": {"type": "string", "maxLength": 20},
                         "shipping_city": {"type": "string", "maxLength": 20},
                         "number_of_items": {"type": "integer", "minimum": 1, "maximum": 9},
                         "is_gift_wrapped": {"type": "boolean"}}}
PROMPT = "Order: Ann Lee ships to Oslo, 3 items, gift wrapped. As JSON: "


@pytest.fixture(scope="module")
def engine(default_model_path):
    with edgeinfer.load(default_model_path, n_ctx=1024, n_threads=1) as eng:
        yield eng


def test_the_sampler_reports_the_forced_continuation(engine):
    grammar = GenerateOptions(json_schema=SCHEMA).validate().resolved_grammar()
    s = Sampler(engine._runtime, SamplingOptions(temperature=0.0), grammar)
    try:
        forced = s.forced()
        # the first key is fixed (the space after the colon may merge with what follows: not forced)
        assert engine.detokenize(forced) == '{"customer_name":'
        for t in forced + engine.tokenize(' "Ann', add_special=False):
            s.accept(t)
        assert s.forced() == []  # inside a free string: more than one token is possible
        unconstrained = Sampler(engine._runtime, SamplingOptions(temperature=0.0), None)
        assert unconstrained.forced() == []
        unconstrained.close()
    finally:
        s.close()


@pytest.mark.parametrize("sampling", [SamplingOptions(temperature=0.0),
                                      SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5)],
                         ids=["greedy", "T=1 seed 5"])
def test_forced_drafts_are_lossless_and_never_rejected(engine, sampling):
    runs = {}
    for method in ("off", "lookup"):
        opts = GenerateOptions(max_tokens=80, json_schema=SCHEMA, sampling=sampling,
                               speculation=SpeculationOptions.parse(method))
        runs[method] = engine.generate(PROMPT, opts).result()
    assert runs["lookup"].tokens == runs["off"].tokens
    spec = runs["lookup"].stats.speculation
    # the four keys and their quotes, colons and commas are forced: at least 20 tokens drafted
    assert spec.drafted >= 20, (spec.drafted, spec.accepted)
    text = runs["off"].text
    forced_text = sum(len(k) + 6 for k in SCHEMA["properties"])  # '"key": ' and ', ' around each
    assert spec.accepted >= 0.8 * spec.drafted, (spec.drafted, spec.accepted, text)
    assert forced_text < len(text)
