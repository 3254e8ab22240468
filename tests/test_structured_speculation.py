"""Structured output stays lossless with speculation, on both faces of the engine.

- Constrained greedy output (a JSON schema and a GBNF grammar) is token-identical with speculation on
  and off, for prompt lookup and for a draft model (the default Q4_1 model drafting for its F16 copy:
  a deterministic drafter, so the draft is greedy and verification is sample-and-match), on an
  Engine (one slot) and on a BatchEngine serving four requests at a time (they share each step).
  The prompts are JSON-extraction prompts (a record in the prompt, a schema to fill from it), where
  lookup finds drafts; every method must actually have drafted and had drafts accepted.
- The rejection rule under a grammar: a draft model *sampling* its drafts (T = 0.8) through a
  grammar whose first tokens are spread; the first three tokens of 100 seeded requests (four at a
  time in a BatchEngine) fit, by chi-square, the grammar-constrained distribution of the target's
  own sampling. The expected side is independent of edgeinfer's sampler: llama.cpp's own grammar
  sampler (`llama_sampler_init_grammar`, fed the prefix with `llama_sampler_accept`) applied to the
  *whole* vocabulary, then its top-k → top-p → min-p → temperature chain, on the target's logits
  (edgeinfer's sampler asks the grammar only about the tokens that can change the result).

Comparisons run on the F16 copy of the default model: its batched and one-row logits round alike
(DESIGN.md), so outputs computed with different batch shapes can be compared token for token.
"""

from __future__ import annotations

import collections
import ctypes
import json
import re
from dataclasses import replace

import numpy as np
import pytest
from test_core import concurrently, f16_path, single  # noqa: F401  (f16_path, single: the engine fixtures)

from edgeinfer import (
    BatchEngine,
    BatchOptions,
    GenerateOptions,
    SamplingOptions,
    SpeculationOptions,
)

pytestmark = pytest.mark.slow

RECORDS = [
    "Customer record 1. Name: Alice Moreau. Age: 34. City: Lyon. Plan: premium. Pets: cat, dog. "
    "Notes: Alice Moreau asked to move her premium plan to Lyon.",
    "Customer record 2. Name: Bruno Silva. Age: 58. City: Porto. Plan: basic. Pets: fish. "
    "Notes: Bruno Silva pays yearly and keeps the basic plan.",
    "Customer record 3. Name: Chen Wei. Age: 27. City: Shanghai. Plan: standard. Pets: none. "
    "Notes: Chen Wei upgraded from basic to standard in Shanghai.",
    "Customer record 4. Name: Dana Novak. Age: 45. City: Prague. Plan: premium. Pets: dog. "
    "Notes: Dana Novak has a premium plan and a dog in Prague.",
]
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "city", "plan", "pets"],
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 32},
        "plan": {"enum": ["basic", "standard", "premium"]},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
}
# A GBNF for the same records: "Name, age N, city C." (a grammar that is not JSON).
GBNF = ('root ::= name ", age " [0-9]{1,3} ", city " name "."\n'
        'name ::= [A-Z] [a-z]{1,12} ( " " [A-Z] [a-z]{1,12} )?\n')
GBNF_RE = re.compile(r"[A-Z][a-z]{1,12}( [A-Z][a-z]{1,12})?, age [0-9]{1,3}, city [A-Z][a-z]{1,12}( [A-Z][a-z]{1,12})?\.")
CONSTRAINTS = {"json_schema": {"json_schema": SCHEMA}, "gbnf": {"grammar": GBNF}}
TOKENS = 72


def messages(record: str, constraint: str) -> list[dict[str, str]]:
    ask = ("Fill the JSON object from this record (name, age, city, plan, pets)" if constraint == "json_schema"
           else "Write the person's name, age and city from this record")
    return [{"role": "user", "content": f"{ask}:\n\n{record}"}]


def check_output(text: str, constraint: str) -> None:
    if constraint == "json_schema":
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert GBNF_RE.fullmatch(text), text


def greedy(constraint: str, spec: SpeculationOptions | None = None) -> GenerateOptions:
    return GenerateOptions(max_tokens=TOKENS, sampling=SamplingOptions(temperature=0.0),
                           speculation=spec or SpeculationOptions(), **CONSTRAINTS[constraint])


def speculation(method: str, draft_path) -> SpeculationOptions:
    """Fixed draft lengths, so each method drafts wherever it has something to draft, whatever this
    machine's costs say (an adaptive policy may choose not to draft on a busy CPU)."""
    if method == "draft":
        return SpeculationOptions(method="draft", draft_model=str(draft_path), adaptive=False, draft_max=3, p_min=0.0)
    return SpeculationOptions(method="lookup", adaptive=False, draft_max=4)


@pytest.fixture(scope="module")
def plain(single):  # noqa: F811
    """(constraint) -> [(prompt tokens, plain constrained greedy tokens)] from the lone Engine."""
    out = {}
    for constraint in CONSTRAINTS:
        rows = []
        for record in RECORDS:
            prompt = single.chat_tokens(messages(record, constraint))
            single.reset()
            done = single.generate(prompt, greedy(constraint)).result()
            assert done.finish_reason == "eos", (constraint, done.text)  # a whole document, not cut off
            check_output(done.text, constraint)
            rows.append((prompt, done.tokens))
        out[constraint] = rows
    return out


@pytest.mark.parametrize("constraint", sorted(CONSTRAINTS))
@pytest.mark.parametrize("method", ["lookup", "draft"])
def test_constrained_greedy_is_identical_with_speculation_on_an_engine(single, plain, default_model_path,  # noqa: F811
                                                                      method, constraint):
    spec = speculation(method, default_model_path)
    drafted = accepted = 0
    for prompt, reference in plain[constraint]:
        single.reset()
        done = single.generate(prompt, greedy(constraint, spec)).result()
        assert done.tokens == reference, (method, constraint, done.text)
        s = done.stats.speculation
        assert s is not None and s.method.startswith(method)
        drafted += s.drafted
        accepted += s.accepted
    assert drafted > 0 and accepted > 0, (method, constraint, drafted, accepted)


@pytest.mark.parametrize("method", ["off", "lookup", "draft"])
def test_constrained_greedy_is_identical_with_speculation_on_a_batch_engine(f16_path, plain, default_model_path,  # noqa: F811
                                                                           method):
    """Four requests at a time share each step (their drafts too): each output is the lone plain one.
    "off" is the control: the batch alone does not change constrained greedy output on this file."""
    spec = speculation(method, default_model_path) if method != "off" else SpeculationOptions()
    with BatchEngine.load(f16_path, batch=BatchOptions(parallel=4, calibrate_when_idle=False), n_ctx=4096,
                          flash_attn=False, speculation=spec) as be:
        drafted = accepted = 0
        for constraint in sorted(CONSTRAINTS):
            rows = plain[constraint]
            done = concurrently(be, [p for p, _ in rows], greedy(constraint, spec))
            for (_, reference), d in zip(rows, done):
                assert d.tokens == reference, (method, constraint, d.text)
                if method != "off":
                    assert d.stats.speculation is not None and d.stats.speculation.method.startswith(method)
                    drafted += d.stats.speculation.drafted
                    accepted += d.stats.speculation.accepted
        m = be.metrics()
        assert m.rows > m.steps  # steps carried several requests
        if method != "off":
            assert drafted > 0 and accepted > 0, (method, drafted, accepted)


# -- the rejection rule under a grammar --------------------------------------------------------------

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "pink", "brown", "black", "white"]
COLOUR_GBNF = "root ::= colour \", \" colour \", \" colour\ncolour ::= " + " | ".join(f'"{c}"' for c in COLOURS) + "\n"
COLOUR_RE = re.compile("(" + "|".join(COLOURS) + ")(, (" + "|".join(COLOURS) + ")){2}")


class GrammarChain:
    """llama.cpp's own samplers, on the whole vocabulary: the grammar sampler (fed a prefix of
    tokens) masks every token it forbids, then top-k → top-p → min-p → temperature
    (test_rejection_sampling.llama_chain_distribution). `distribution(row, prefix)` is what plain constrained
    sampling draws from after `prefix`. Independent of edgeinfer's Sampler (which asks the grammar
    about as few tokens as decide the result)."""

    def __init__(self, model_path, gbnf: str, o: SamplingOptions):
        from vocab_only import VocabOnly

        from edgeinfer.llama_backend import backend

        self.ll = backend()
        self.vocab = VocabOnly(model_path)
        self.gbnf, self.o = gbnf.encode(), o

    def distribution(self, row: np.ndarray, prefix: tuple[int, ...]) -> dict[int, float]:
        from test_rejection_sampling import llama_chain_distribution

        ll = self.ll
        grammar = ll.llama_sampler_init_grammar(self.vocab.vocab, self.gbnf, b"root")
        assert grammar
        try:
            for t in prefix:
                ll.llama_sampler_accept(grammar, t)
            n = len(row)
            data = np.zeros(n, dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)])
            data["id"], data["logit"] = np.arange(n), row
            assert data.itemsize == ctypes.sizeof(ll.llama_token_data)
            arr = ll.llama_token_data_array(data=data.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)), size=n,
                                            selected=-1, sorted=False)
            ll.llama_sampler_apply(grammar, ctypes.byref(arr))  # the grammar's mask, on every token
            assert ctypes.addressof(arr.data.contents) == data.ctypes.data and arr.size == n
        finally:
            ll.llama_sampler_free(grammar)
        masked = np.full(n, -np.inf, dtype=np.float32)
        masked[data["id"]] = data["logit"]
        # then top-k → top-p → min-p → temperature, as llama.cpp's chain applies them after a grammar
        return {t: p for t, p in llama_chain_distribution(masked, self.o).items() if p > 0}

    def close(self) -> None:
        self.vocab.close()


def constrained_chi_square(engine, chain: GrammarChain, prompt: list[int], observed: collections.Counter, n: int,
                           length: int):
    """Chi-square of the observed first `length` tokens against the exact constrained probabilities
    (walking the tree of prefixes; sequences expected fewer than 5 times pooled)."""
    from sequence_chi_square import chi_square_of, expected_sequences

    return chi_square_of(expected_sequences(engine, prompt, chain.distribution, n, length), observed, n)


# The sample: enough seeded requests that the chi-square, at α = 1e-3, rejects the first three tokens
# drawn at twice the temperature (1.6 for 0.8: a rule that lost the request's temperature under the
# grammar; effect size w = 0.69 on this prompt, 4 degrees of freedom) with power 0.998 (80 requests:
# 0.97; the 200 it once took: 1.0). test_the_reference_has_the_power_to_see_a_wrong_distribution
# computes that power and draws such a sample.
REQUESTS = 100
COLOURS_SAMPLING = SamplingOptions(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02)


def test_the_rejection_rule_keeps_the_constrained_distribution(f16_path, default_model_copy, single):  # noqa: F811
    """A draft model that samples (T = 0.8, fixed length 3) under a grammar, four requests a step:
    the first three tokens are distributed as the target's constrained sampling, every output is in
    the grammar's language, and drafts are both kept and rejected (the rule is exercised). The draft
    is a Q2_K copy of the model: its q differs enough from p to be rejected about a quarter of the
    time here (the Q4_1 file drafting for its F16 copy is kept ~100 %: the rule would hardly run)."""
    prompt = single.chat_tokens([{"role": "user", "content": "Name three colours, separated by commas."}])
    sampling = COLOURS_SAMPLING
    spec = SpeculationOptions(method="draft", draft_model=str(default_model_copy("Q2_K")), adaptive=False,
                              draft_max=3, p_min=0.0)
    n, length = REQUESTS, 3
    observed: collections.Counter = collections.Counter()
    drafted = accepted = 0
    with BatchEngine.load(f16_path, batch=BatchOptions(parallel=4, calibrate_when_idle=False), n_ctx=4096,
                          flash_attn=False, speculation=spec) as be:
        for group in range(0, n, 4):
            gens = [be.submit(prompt, GenerateOptions(max_tokens=24, grammar=COLOUR_GBNF, speculation=spec,
                                                      sampling=replace(sampling, seed=seed)))
                    for seed in range(group, group + 4)]
            for g in gens:
                done = g.result()
                assert done.finish_reason == "eos" and COLOUR_RE.fullmatch(done.text), done.text
                observed[tuple(done.tokens[:length])] += 1
                drafted += done.stats.speculation.drafted
                accepted += done.stats.speculation.accepted
    assert drafted >= 2 * n and 0.1 * drafted < drafted - accepted < 0.9 * drafted, (drafted, accepted)
    chain = GrammarChain(f16_path, COLOUR_GBNF, sampling)
    try:
        result, table = constrained_chi_square(single, chain, prompt, observed, n, length)
    finally:
        chain.close()
    print(f"\n{n} requests: drafted {drafted}, accepted {accepted}; chi-square p = {result.pvalue:.3g}")
    for key, obs, exp in table:
        print(f"  {single.detokenize(list(key))!r:40} observed {obs:4d} expected {exp:7.1f}")
    assert result.pvalue > 1e-3, (result, table)


def test_the_reference_has_the_power_to_see_a_wrong_distribution(f16_path, single):  # noqa: F811
    """The chi-square above can fail: sequences drawn from the constrained chain at another
    temperature (1.6 for 0.8: what a rule that lost the temperature under a grammar would give) are
    rejected by it with power at least 0.99 over REQUESTS runs (the noncentral chi-square), and one
    such sample of that size is rejected."""
    from sequence_chi_square import chi_square_of, chi_square_power, expected_sequences, memoized

    prompt = single.chat_tokens([{"role": "user", "content": "Name three colours, separated by commas."}])
    sampling = COLOURS_SAMPLING
    wrong = GrammarChain(f16_path, COLOUR_GBNF, replace(sampling, temperature=1.6))
    rng = np.random.default_rng(5)
    n, length = REQUESTS, 3
    observed: collections.Counter = collections.Counter()
    chain = GrammarChain(f16_path, COLOUR_GBNF, sampling)
    try:
        right_d, wrong_d = memoized(chain.distribution), memoized(wrong.distribution)
        power, w = chi_square_power(single, prompt, right_d, wrong_d, n, length)
        print(f"\npower {power:.4f} over {n} requests against twice the temperature (w = {w:.2f})")
        assert power >= 0.99, (power, w)
        dists: dict[tuple[int, ...], tuple[list[int], np.ndarray]] = {}
        for _ in range(n):
            prefix: tuple[int, ...] = ()
            for _ in range(length):
                if prefix not in dists:
                    d = wrong_d(single.logits(prompt + list(prefix), start=len(prompt) + len(prefix) - 1)[-1], prefix)
                    dists[prefix] = (list(d), np.array(list(d.values())))
                ids, probs = dists[prefix]
                prefix = (*prefix, ids[int(rng.choice(len(ids), p=probs))])
            observed[prefix] += 1
        result, table = chi_square_of(expected_sequences(single, prompt, right_d, n, length), observed, n)
    finally:
        wrong.close()
        chain.close()
    assert result.pvalue < 1e-3, (result, table)
