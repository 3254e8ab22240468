"""Every sampling option, and grammar-constrained sampling, against independent references.

- Token identity with llama-cpp-python's own high-level sampler chain (`llama_cpp.Llama.generate`)
  on the same F16 file: greedy with penalties, and seeded sampling with every option set to a
  non-default value (same chain, same llama.cpp seed: the same tokens).
- The distribution: `Sampler.distribution` equals a plain numpy reimplementation written here
  (full sort, penalties counted by hand over the generated tokens of the window), and what the
  llama.cpp chain samples (`Sampler.sample`) and what numpy draws (`Sampler.draw`) fit it by χ².
- The penalty window holds generated tokens only, never the prompt's (SamplingOptions).
- Grammars: the mask equals the set of tokens whose text a regex allows (computed here from the
  vocabulary), JSON-schema output validates with `jsonschema`, and bad grammars and schemas are
  one-line errors that come fast.

The F16 copy keeps llama.cpp's logits the same between batch shapes (DESIGN.md), so our engine and
llama-cpp-python see the same rows.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import edgeinfer
from edgeinfer import GenerateOptions, InvalidOptionError, SamplingOptions
from edgeinfer.engine.structured.grammar import Grammar, check_gbnf
from edgeinfer.engine.structured.json_schema import MAX_SCHEMA_BYTES, json_schema_to_grammar
from edgeinfer.engine.core.sampler import LLAMA_DEFAULT_SEED, Sampler, llama_seed

P_MIN = 1e-3  # χ² p-value below which a fit is rejected (each test has a case that must fail it)


# -- references ---------------------------------------------------------------------------------------


def reference_probs(logits: np.ndarray, o: SamplingOptions, generated: list[int] = (),
                    allowed: np.ndarray | None = None) -> dict[int, float]:
    """What llama.cpp's chain samples from, written plainly: mask, penalties over the window of
    generated tokens (float32, as llama.cpp), a full descending sort, top-k, top-p, min-p, softmax."""
    z = np.array(logits, dtype=np.float32, copy=True)
    if allowed is not None:
        z[~allowed] = -np.inf
    window = list(generated)[-o.repeat_last_n:] if o.repeat_last_n else []
    for tok, c in Counter(window).items():
        v = z[tok]
        v = v * np.float32(o.repeat_penalty) if v <= 0 else v / np.float32(o.repeat_penalty)
        z[tok] = np.float32(v - (np.float32(c) * np.float32(o.frequency_penalty) + np.float32(o.presence_penalty)))
    order = np.argsort(-z.astype(np.float64), kind="stable")
    order = order[np.isfinite(z[order])]
    if o.greedy:
        return {int(order[0]): 1.0}
    if o.top_k > 0:
        order = order[: o.top_k]
    zz = z[order].astype(np.float64)
    if o.top_p < 1.0:
        p = np.exp(zz - zz[0])
        cum = np.cumsum(p / p.sum())
        n = next(i for i, c in enumerate(cum) if c >= o.top_p) + 1
        order, zz = order[:n], zz[:n]
    if o.min_p > 0.0:
        keep = zz >= zz[0] + np.log(o.min_p)
        order, zz = order[keep], zz[keep]
    p = np.exp((zz - zz[0]) / o.temperature)
    return {int(t): float(v) for t, v in zip(order, p / p.sum())}


def chi2_pvalue(counts: Counter, probs: dict[int, float]) -> float:
    """χ² goodness of fit; bins expected below 5 are pooled (with any token outside the support)."""
    from scipy import stats

    n = sum(counts.values())
    big = [t for t, p in probs.items() if p * n >= 5]
    observed = [counts.get(t, 0) for t in big]
    expected = [probs[t] * n for t in big]
    rest_obs = n - sum(observed)
    rest_exp = n - sum(expected)
    if rest_exp >= 1e-9 * n:
        observed.append(rest_obs)
        expected.append(rest_exp)
    elif rest_obs:
        return 0.0  # a token the reference gives (almost) no mass came out
    if len(observed) < 2:
        return 1.0
    expected = np.array(expected) * n / sum(expected)
    return float(stats.chisquare(observed, expected).pvalue)


# -- model-free ---------------------------------------------------------------------------------------


def test_penalty_and_seed_options_are_validated():
    ok = SamplingOptions(presence_penalty=-2.0, frequency_penalty=2.0, seed=-(2**63)).validate()
    assert ok.presence_penalty == -2.0
    assert SamplingOptions(seed=2**63 - 1).validate().seed == 2**63 - 1
    assert (SamplingOptions().presence_penalty, SamplingOptions().frequency_penalty) == (0.0, 0.0)
    for bad, what in [({"presence_penalty": 2.01}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
                      ({"presence_penalty": float("nan")}, "presence_penalty"), ({"seed": 2**63}, "seed"),
                      ({"seed": -(2**63) - 1}, "seed"), ({"seed": 1.5}, "seed"), ({"repeat_last_n": -1}, "repeat_last_n")]:
        with pytest.raises(InvalidOptionError, match=what):
            SamplingOptions(**bad).validate()


def test_seed_mixing(monkeypatch):
    seeds = [*range(-500, 500), 2**32 - 1, 2**32, 2**32 + 5, 2**63 - 1, -(2**63)]
    mixed = [llama_seed(s) for s in seeds]
    assert len(set(mixed)) == len(seeds)  # no wrap mod 2**32: 5 and 2**32 + 5 differ, -1 and 2**32 - 1 too
    assert all(0 <= m < LLAMA_DEFAULT_SEED for m in mixed)
    assert llama_seed(42) == llama_seed(42)
    # A seed whose hash lands on llama.cpp's "random" value is moved off it.
    import edgeinfer.engine.core.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "_seed_digest", lambda seed: b"\xff" * 16)
    assert llama_seed(7) == LLAMA_DEFAULT_SEED - 1


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "string", "pattern": "^a+$"}, '"pattern"'),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, '"oneOf"'),
    ({"not": {"type": "string"}}, '"not"'),
    ({"type": "object", "patternProperties": {"^x": {}}}, '"patternProperties"'),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, '"uniqueItems"'),
    ({"type": "integer", "multipleOf": 3}, '"multipleOf"'),
    ({"type": "string", "format": "email"}, '"format": \'email\''),
    ({"if": {"type": "string"}, "then": {"minLength": 1}}, '"if"'),
    ({"type": "object", "properties": {"a": {"type": "number", "minimum": 0.5, "maximum": 2}}}, "minimum 0.5"),
    ({"type": "string", "maxLength": 5000}, "maxLength 5000"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, r"\$ref"),
])
def test_unsupported_schema_keywords_are_named(schema, keyword):
    with pytest.raises(InvalidOptionError) as e:
        json_schema_to_grammar(schema)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 300
    assert re.search(keyword, msg), msg
    # an integer with non-whole bounds is fine: the bounds round inwards
    json_schema_to_grammar({"type": "integer", "minimum": 0.5, "maximum": 2.5})


def test_huge_and_recursive_schemas_fail_fast():
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 1000} for i in range(1100)}}
    recursive = {"$defs": {"node": {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
                 "$ref": "#/$defs/node"}
    self_ref = {"type": "object", "properties": {"next": {"$ref": "#"}}}
    deep = '{"type":"array","items":' * 5000 + "{}" + "}" * 5000
    for schema, match in [(huge, "too large"), (json.dumps(huge), "too large"), (deep, "too large|nest")]:
        t0 = time.perf_counter()
        with pytest.raises(InvalidOptionError, match=match) as e:
            GenerateOptions(json_schema=schema).validate()
        assert time.perf_counter() - t0 < 0.5
        assert "\n" not in str(e.value)
    assert len(json.dumps(huge)) > MAX_SCHEMA_BYTES
    # A request's schema runs on llguidance, which enforces recursion; the GBNF compiler (tool calls)
    # still refuses it.
    for schema in (recursive, self_ref):
        GenerateOptions(json_schema=schema).validate()
        with pytest.raises(InvalidOptionError, match="recursive"):
            json_schema_to_grammar(schema)


@pytest.mark.parametrize("gbnf, match", [
    ('root ::= "a" root', "matches no finite text"),  # the grammar matches nothing
    ('root ::= item\nitem ::= "(" item ")"', "matches no finite text"),
    ("root ::= undefined-rule", "Rule 'undefined-rule' not found"),
    ('root ::= [a-', "unterminated character class"),
    ('root ::= root "a"', "matches no finite text"),
    ('start ::= "a"', "No 'root' rule found"),
    ('root ::= "a" <|im_end|>', "names a token"),
    ("root ::= " + "(" * 1000 + '"a"' + ")" * 1000, "parentheses nested 33: at most 32"),
    ("", "empty"),
])
def test_bad_grammars_are_one_line_errors(gbnf, match, capfd):
    t0 = time.perf_counter()
    with pytest.raises(InvalidOptionError, match=match) as e:
        GenerateOptions(grammar=gbnf).validate()
    assert time.perf_counter() - t0 < 0.5
    assert "\n" not in str(e.value)
    assert "error parsing grammar" not in capfd.readouterr().err  # llama.cpp's stderr line was taken in


def test_grammar_options():
    check_gbnf('root ::= ("a" root)? "b"')
    check_gbnf('root ::= <[12]> "a"')  # token references wait for a vocabulary
    assert GenerateOptions(grammar='root ::= "x"').resolved_grammar() == Grammar('root ::= "x"')
    assert GenerateOptions(json_schema='{"type": "boolean"}').validate().resolved_grammar() == \
        Grammar("", json_schema='{"type": "boolean"}')
    assert GenerateOptions().resolved_grammar() is None
    with pytest.raises(InvalidOptionError, match="either grammar or json_schema"):
        GenerateOptions(grammar='root ::= "x"', json_schema={}).validate()
    with pytest.raises(InvalidOptionError, match="grammar must be"):
        GenerateOptions(grammar=3).validate()  # type: ignore[arg-type]
    for pattern in ["(?<=a)b", "(?P<x>a)", "(?i)abc", "a("]:
        with pytest.raises(InvalidOptionError, match="trigger pattern"):
            Grammar('root ::= "x"', trigger_patterns=(pattern,)).validate()
    Grammar('root ::= "x"', trigger_patterns=(r"[\s\S]*?(<tool_call>)[\s\S]*",), trigger_tokens=(5,)).validate()


# -- on the default model -----------------------------------------------------------------------------

PROMPT = "Once upon a time, there was a"


@pytest.fixture(scope="module")
def f16_path(default_model_copy) -> Path:
    return default_model_copy("F16")


@pytest.fixture(scope="module")
def engine(f16_path):
    eng = edgeinfer.load(f16_path, n_ctx=512, n_threads=1, flash_attn=False)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def runtime(f16_path):
    """A llama.cpp context on the same file, for Samplers fed logits rows as arrays."""
    from edgeinfer.engine.llama.runtime import LlamaRuntime
    from edgeinfer.engine.core.options import LoadOptions

    rt = LlamaRuntime(f16_path, LoadOptions(n_ctx=64, n_threads=1).validate())
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def reference(f16_path):
    import llama_cpp

    llm = llama_cpp.Llama(str(f16_path), n_ctx=512, n_threads=1, n_batch=512, verbose=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def row(engine) -> np.ndarray:
    """The logits after PROMPT: a broad distribution (many plausible continuations)."""
    return engine.logits(engine.tokenize(PROMPT))[-1].copy()


def _grammar_accepts(runtime, grammar: Grammar, text: str) -> bool:
    """Whether llama.cpp's grammar engine takes `text` (tokenized) to a complete match."""
    s = Sampler(runtime, SamplingOptions(temperature=0), grammar)
    try:
        for t in runtime.tokenize(text, False, False):
            if not s.allowed(t):
                return False
            s.accept(t)
        return s.allowed(runtime.eos)
    finally:
        s.close()


@pytest.mark.slow
def test_json_schema_grammar_accepts_exactly_the_valid_documents(runtime):
    """The compiled grammar, run by llama.cpp on documents (their keys in declared order: the order
    the grammar generates), takes the ones jsonschema validates and refuses the others: the bounds
    of numbers, lengths and counts are exact; anyOf, const, $ref, type lists and maps too."""
    import jsonschema  # the test extra installs it
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "x"], "properties": {
        "n": {"type": "integer", "minimum": -12, "exclusiveMaximum": 105},
        "x": {"type": "number", "exclusiveMinimum": -3, "maximum": 7},
        "s": {"type": "string", "minLength": 2, "maxLength": 4},
        "e": {"enum": ["a", 1, None]},
        "l": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
        "d": {"type": "string", "format": "date"},
        "u": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
        "c": {"const": "k"},
        "r": {"$ref": "#/$defs/pt"},
        "t": {"type": ["string", "null"], "maxLength": 2},
        "m": {"type": "object", "additionalProperties": {"type": "integer"}}},
        "$defs": {"pt": {"type": "object", "required": ["x"], "additionalProperties": False,
                         "properties": {"x": {"type": "integer"}}}}}
    g = json_schema_to_grammar(schema)
    docs = ['{"n": -12, "x": 7}', '{"n": 104, "x": -2.999}', '{"n":0,"x":0,"s":"ab","e":null,"l":[true,false]}',
            '{"n": 105, "x": 1}', '{"n": -13, "x": 1}', '{"n": 1, "x": 7.0001}', '{"n": 1, "x": -3}',
            '{"n": 1, "x": -3.0}', '{"n": 1, "x": 7.000}', '{"n": 1, "x": 1, "s": "a"}', '{"n": 1, "x": 1, "s": "abcde"}',
            '{"n": 1, "x": 1, "l": []}', '{"n": 1, "x": 1, "l": [true, true, true]}', '{"n": 1, "x": 1, "e": "b"}',
            '{"x": 1}', '{"n": 1, "x": 1, "z": 1}', '{"n": 01, "x": 1}', '{"n": 50, "x": 6.5}', '{"n": 99, "x": -0.5}',
            '{\n  "n": 7,\n  "x": 0.25,\n  "e": "a"\n}', '{"n": 1, "x": 1, "d": "2024-02-29"}', '{"n": 1, "x": 1, "d": "24-02-03"}',
            '{"n": 1, "x": 1, "u": 9}', '{"n": 1, "x": 1, "u": null}', '{"n": 1, "x": 1, "u": 10}', '{"n": 1, "x": 1, "u": "a"}',
            '{"n": 1, "x": 1, "c": "k"}', '{"n": 1, "x": 1, "c": "j"}', '{"n": 1, "x": 1, "r": {"x": -4}}',
            '{"n": 1, "x": 1, "r": {}}', '{"n": 1, "x": 1, "r": {"x": 1, "y": 2}}', '{"n": 1, "x": 1, "t": null}',
            '{"n": 1, "x": 1, "t": "ab"}', '{"n": 1, "x": 1, "t": "abc"}', '{"n": 1, "x": 1, "m": {"a": 1, "b": 2}}',
            '{"n": 1, "x": 1, "m": {"a": "1"}}', '{"n": 1, "x": 1, "m": {}}']
    for doc in docs:
        try:
            jsonschema.validate(json.loads(doc), schema, format_checker=jsonschema.FormatChecker())
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
        assert _grammar_accepts(runtime, g, doc) == valid, doc


def _reference_tokens(llm, prompt: list[int], n: int, o: SamplingOptions) -> list[int]:
    """llama-cpp-python's own loop: its sampler chain (penalties → top-k → typical → top-p → min-p →
    temp → dist), penalties over its generated tokens in a window of last_n_tokens_size."""
    llm.reset()
    llm.last_n_tokens_size = o.repeat_last_n
    llm.set_seed(llama_seed(o.seed) if o.seed is not None else 0)
    out = []
    for tok in llm.generate(prompt, temp=o.temperature, top_k=o.top_k, top_p=o.top_p, min_p=o.min_p,
                            repeat_penalty=o.repeat_penalty, frequency_penalty=o.frequency_penalty,
                            presence_penalty=o.presence_penalty):
        if tok == llm.token_eos() or len(out) == n:
            break
        out.append(tok)
    return out


PENALIZED = [
    SamplingOptions(temperature=0, repeat_penalty=1.5, repeat_last_n=64),
    SamplingOptions(temperature=0, frequency_penalty=1.2, presence_penalty=0.6, repeat_last_n=12),
    SamplingOptions(temperature=0, repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.4, repeat_last_n=4),
]


@pytest.mark.slow
@pytest.mark.parametrize("o", PENALIZED, ids=["repeat", "frequency+presence", "all, window 4"])
def test_greedy_with_penalties_matches_llama_cpp_python(engine, reference, o):
    prompt = engine.tokenize("List the days of the week: Monday, Tuesday,")
    ours = engine.generate(prompt, GenerateOptions(max_tokens=40, sampling=o)).result().tokens
    ref = _reference_tokens(reference, prompt, 40, o)
    assert ours == ref
    plain = engine.generate(prompt, GenerateOptions(max_tokens=40, sampling=SamplingOptions(temperature=0))).result().tokens
    assert ours != plain  # the penalties changed something: the comparison is not vacuous


SAMPLED = [
    SamplingOptions(temperature=1.3, top_k=0, top_p=0.85, min_p=0.0, seed=-7),
    SamplingOptions(temperature=0.8, top_k=12, top_p=1.0, min_p=0.0, seed=2**40 + 3),
    SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.08, seed=0),
    SamplingOptions(temperature=1.1, top_k=30, top_p=0.9, min_p=0.02, repeat_penalty=1.4, repeat_last_n=6,
                    presence_penalty=0.7, frequency_penalty=0.4, seed=-(2**63)),
    SamplingOptions(temperature=0.9, top_k=50, top_p=0.97, min_p=0.01, repeat_penalty=0.8, repeat_last_n=20,
                    presence_penalty=-0.5, frequency_penalty=-0.3, seed=2**63 - 1),
]
SAMPLED_IDS = ["top-p", "top-k", "min-p", "penalties", "negative penalties"]


@pytest.mark.slow
@pytest.mark.parametrize("o", SAMPLED, ids=SAMPLED_IDS)
def test_seeded_sampling_matches_llama_cpp_python(engine, reference, o):
    """Same chain, same llama.cpp seed (our mix of the request's seed): the same tokens."""
    prompt = engine.tokenize(PROMPT)
    ours = engine.generate(prompt, GenerateOptions(max_tokens=32, sampling=o)).result().tokens
    assert ours == _reference_tokens(reference, prompt, 32, o)
    again = engine.generate(prompt, GenerateOptions(max_tokens=32, sampling=o)).result().tokens
    assert again == ours


@pytest.mark.slow
def test_seeds_do_not_wrap(engine):
    prompt = engine.tokenize(PROMPT)

    def run(seed: int) -> list[int]:
        o = GenerateOptions(max_tokens=12, sampling=SamplingOptions(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
        return engine.generate(prompt, o).result().tokens

    assert run(5) != run(5 + 2**32)
    assert run(-1) != run(2**32 - 1)
    assert run(-(2**63)) == run(-(2**63))


def _history(row: np.ndarray) -> list[int]:
    """A generated history over the row's likeliest tokens, with repeats, longer than small windows:
    its first tokens fall out of a window of 6."""
    top = [int(t) for t in np.argsort(-row)[:6]]
    return [top[5], top[4], top[0], top[1], top[0], top[2], top[0], top[3], top[1], top[0]]


@pytest.mark.slow
@pytest.mark.parametrize("o", SAMPLED, ids=SAMPLED_IDS)
def test_distribution_and_samples_fit_the_reference(runtime, row, o):
    history = _history(row) if o.penalized else []
    ref = reference_probs(row, o, history)
    assert len(ref) >= 5  # broad enough for the χ² to mean something

    def fresh(seed: int) -> Sampler:
        s = Sampler(runtime, SamplingOptions(**{**o.__dict__, "seed": seed}))
        for t in history:
            s.accept(t)
        return s

    s = fresh(1)
    d = s.distribution(row)
    assert d.ids.tolist() == sorted(ref)
    np.testing.assert_allclose(d.probs, [ref[t] for t in sorted(ref)], rtol=2e-4, atol=1e-7)
    n = 600 if o.top_k == 0 and o.top_p < 1.0 else 1500  # llama.cpp's top-p alone sorts the vocabulary: 8 ms a draw
    if o.penalized:  # the state changes with every accepted token: one sampler per draw
        chain = Counter()
        for seed in range(n):
            f = fresh(seed)
            chain[f.sample(row)] += 1
            f.close()
    else:  # one stream of draws from one seeded chain
        chain = Counter(s.sample(row) for _ in range(n))
    if o.penalized:
        numpy_draws = Counter()
        for seed in range(n):
            f = fresh(seed)
            numpy_draws[f.draw(row)] += 1
            f.close()
    else:
        numpy_draws = Counter(s.draw(row) for _ in range(n))
    s.close()
    assert chi2_pvalue(chain, ref) > P_MIN
    assert chi2_pvalue(numpy_draws, ref) > P_MIN
    # Power: the same draws against the distribution without penalties / with a doubled temperature.
    other = reference_probs(row, SamplingOptions(**{**o.__dict__, "repeat_last_n": 0, "temperature": o.temperature * 2}))
    assert chi2_pvalue(chain, other) < 1e-6


@pytest.mark.slow
def test_penalty_window_holds_generated_tokens_only(engine, runtime):
    """The prompt never enters the window (SamplingOptions): the first token of a penalized request
    is the unpenalized one, although the prompt repeats it — and counting the prompt would change it."""
    prompt = engine.tokenize("Say apple five times: apple apple apple apple")
    row = engine.logits(prompt)[-1]
    assert int(np.argmax(row)) in prompt  # the likeliest next token is one the prompt repeats
    o = SamplingOptions(temperature=0, repeat_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0, repeat_last_n=64)
    first = engine.generate(prompt, GenerateOptions(max_tokens=1, sampling=o)).result().tokens[0]
    assert first == int(np.argmax(row))
    assert next(iter(reference_probs(row, o, prompt))) != first  # a window with the prompt picks another
    s = Sampler(runtime, o)
    s.prime(prompt)
    assert s.sample(row) == first
    # the generated token is in the window from then on, and leaves it after repeat_last_n more
    s2 = Sampler(runtime, SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, frequency_penalty=2.0, repeat_last_n=2))
    base = s2.distribution(row).prob(first)
    s2.accept(first)
    assert s2.distribution(row).prob(first) < base / 3
    s2.accept(11)
    s2.accept(12)
    assert s2.distribution(row).prob(first) == pytest.approx(base, rel=0.02)
    for x in (s, s2):
        x.close()


@pytest.mark.slow
def test_repeat_last_n_zero_turns_penalties_off(runtime, row):
    o = SamplingOptions(temperature=1.0, repeat_penalty=1.8, frequency_penalty=1.0, presence_penalty=1.0, repeat_last_n=0)
    s = Sampler(runtime, o)
    for t in _history(row):
        s.accept(t)
    assert not o.penalized
    np.testing.assert_allclose(s.distribution(row).probs, Sampler(runtime, SamplingOptions(temperature=1.0)).distribution(row).probs)


# -- grammars on the model ----------------------------------------------------------------------------


def _allowed_by_regex(runtime, pattern: str, eog: bool) -> np.ndarray:
    """Tokens whose text (strict UTF-8) fully matches `pattern`, computed from the vocabulary."""
    rx = re.compile(pattern)
    out = np.zeros(runtime.facts.n_vocab, dtype=bool)
    for t in range(runtime.facts.n_vocab):
        if runtime.is_eog(t):
            out[t] = eog
            continue
        try:
            text = runtime.piece(t).decode("utf-8")
        except UnicodeDecodeError:
            continue
        out[t] = bool(text) and rx.fullmatch(text) is not None
    return out


@pytest.mark.slow
def test_grammar_mask_and_constrained_samples(runtime, row):
    """The constrained distribution is the reference over the tokens a regex allows (from the
    vocabulary, not from llama.cpp), before and after the grammar advances; the chain's samples and
    numpy's draws fit it, and not the unconstrained one."""
    # No "l" and no "y": the row's two likeliest tokens (" little", " young") are out.
    g = Grammar("root ::= [a-km-xz ]+")
    o = SamplingOptions(temperature=1.2, top_k=0, top_p=1.0, min_p=0.01, seed=3)
    start = _allowed_by_regex(runtime, r"[a-km-xz ]+", eog=False)
    after = _allowed_by_regex(runtime, r"[a-km-xz ]+", eog=True)  # once a character is out, it may end
    assert 1000 < start.sum() < 0.9 * runtime.facts.n_vocab
    s = Sampler(runtime, o, g)
    ref = reference_probs(row, o, allowed=start)
    d = s.distribution(row)
    assert d.ids.tolist() == sorted(ref)
    np.testing.assert_allclose(d.probs, [ref[t] for t in sorted(ref)], rtol=2e-4, atol=1e-7)
    full = Sampler(runtime, SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), g)
    assert full.distribution(row).ids.tolist() == np.flatnonzero(start).tolist()  # the support is the allowed set
    full.close()
    s.accept(runtime.tokenize(" the", False, False)[0])  # from here on every state is the same
    ref2 = reference_probs(row, o, allowed=after)
    assert s.distribution(row).ids.tolist() == sorted(ref2)
    n = 1500
    chain = Counter(s.sample(row) for _ in range(n))
    draws = Counter(s.draw(row) for _ in range(n))
    assert chi2_pvalue(chain, ref2) > P_MIN
    assert chi2_pvalue(draws, ref2) > P_MIN
    assert chi2_pvalue(chain, reference_probs(row, o)) < 1e-6  # the unconstrained distribution: rejected
    s.close()
    # A grammar that completes leaves only the end of generation; a forbidden token is refused in
    # Python (llama.cpp would abort the process).
    done = Sampler(runtime, SamplingOptions(temperature=1.0), Grammar('root ::= [a-z ]+ "."'))
    for t in runtime.tokenize(" walk.", False, False):
        done.accept(t)
    assert all(runtime.is_eog(int(t)) for t in done.distribution(row).ids)
    with pytest.raises(InvalidOptionError, match="not allowed by the grammar"):
        done.accept(runtime.tokenize(" x", False, False)[0])
    done.close()


@pytest.mark.slow
@pytest.mark.parametrize("o", [SamplingOptions(temperature=0), *SAMPLED], ids=["greedy", *SAMPLED_IDS])
def test_constrained_distribution_for_every_option(runtime, row, o):
    """Under a grammar that forbids the row's likeliest tokens, for every option set (penalties over
    a generated history too): exactly the reference over the allowed tokens. The sampler checks only
    as many tokens against the grammar as decide the result; this is the check that it stops right."""
    pattern = r"[a-km-xz ]+"
    allowed = _allowed_by_regex(runtime, pattern, eog=True)
    history = [int(t) for t in np.argsort(-np.where(allowed, row, -np.inf))[:4]] * 2
    s = Sampler(runtime, o, Grammar(f"root ::= {pattern}"))
    for t in history:
        s.accept(t)
    ref = reference_probs(row, o, history, allowed=allowed)
    d = s.distribution(row)
    assert d.ids.tolist() == sorted(ref)
    np.testing.assert_allclose(d.probs, [ref[t] for t in sorted(ref)], rtol=2e-4, atol=1e-7)
    tok = s.sample(row)
    assert tok in ref
    s.close()


@pytest.mark.slow
def test_rejection_rule_under_a_grammar(runtime, engine, row):
    """Speculative sampling with constrained p (the target's sampler) and constrained q (a fork on a
    draft's row): every token is distributed as p, and a token the grammar forbids is never kept."""
    from edgeinfer.engine.core.sampler import verify_sampled_draft

    o = SamplingOptions(temperature=1.0, top_k=0, top_p=0.95, min_p=0.02)
    g = Grammar("root ::= [a-km-xz ]+")
    target = Sampler(runtime, o, g)
    p = target.distribution(row)
    draft_row = engine.logits(engine.tokenize("In a small village there lived a"))[-1]
    fork = target.fork()
    q = fork.distribution(draft_row)
    fork.close()
    assert set(q.ids.tolist()) != set(p.ids.tolist())
    rng = np.random.default_rng(11)
    counts, kept = Counter(), 0
    for _ in range(4000):
        x = q.draw(rng)
        k, tok = verify_sampled_draft(p, q, x, rng)
        counts[tok] += 1
        kept += k
    assert set(counts) <= set(p.ids.tolist())
    ref = dict(zip(p.ids.tolist(), p.probs.tolist()))
    assert chi2_pvalue(counts, ref) > P_MIN
    assert 0 < kept < 4000
    target.close()


@pytest.mark.slow
def test_rows_of_a_stateful_request_need_their_token_committed(runtime, row, monkeypatch):
    """With a grammar (or penalties) row i+1's distribution depends on row i's token: asking for it
    before `accept` is a loud error, not a silently stale distribution."""
    monkeypatch.setattr(runtime, "logits_row", lambda i: row)
    s = Sampler(runtime, SamplingOptions(temperature=1.0), Grammar("root ::= [a-z ]+"))
    p0 = s.distribution(0)
    assert s.distribution(0).ids.tolist() == p0.ids.tolist()  # the same row again is fine
    with pytest.raises(RuntimeError, match="accept"):
        s.distribution(1)
    s.accept(int(p0.ids[np.argmax(p0.probs)]))
    s.distribution(1)
    s.close()
    plain = Sampler(runtime, SamplingOptions(temperature=1.0))  # stateless: rows in any order
    plain.distribution(0)
    plain.distribution(1)
    plain.close()


@pytest.mark.slow
def test_greedy_grammar_fork_and_lazy(runtime, row):
    g = Grammar('root ::= " " [0-9]+')
    s = Sampler(runtime, SamplingOptions(temperature=0), g)
    allowed = _allowed_by_regex(runtime, r" [0-9]*", eog=False)
    before = s.distribution(row).ids.tolist()
    assert before == [int(np.argmax(np.where(allowed, row, -np.inf)))]
    # fork: an independent copy that advances along drafted tokens and is thrown away
    f = s.fork()
    tok = f.sample(row)
    assert tok == before[0]
    digits = _allowed_by_regex(runtime, r"[0-9]+", eog=runtime.piece(tok) != b" ")
    nxt = f.distribution(row).ids.tolist()
    assert len(nxt) == 1 and digits[nxt[0]]
    f.close()
    assert s.distribution(row).ids.tolist() == before and s.sample(row) == tok  # the parent did not move
    s.close()
    # lazy: nothing is constrained until the trigger token, then the grammar holds from it
    brace = runtime.tokenize("{", False, False)[0]
    lazy = Sampler(runtime, SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
                   Grammar('root ::= "{" [0-9]+ "}"', trigger_tokens=(brace,)))
    assert len(lazy.distribution(row).ids) == runtime.facts.n_vocab
    lazy.accept(runtime.tokenize(" hello", False, False)[0])
    lazy.accept(brace)
    ids = lazy.distribution(row).ids
    assert 0 < len(ids) < 100 and all(runtime.piece(int(t)).decode().isdigit() for t in ids)
    lazy.close()


@pytest.mark.slow
def test_grammar_that_no_token_can_follow_is_a_clear_error(engine):
    # refused when the request is made (edgeinfer.GrammarError), before it queues for the engine
    with pytest.raises(edgeinfer.GrammarError, match="allows no token"):
        # (llama.cpp's grammar sampler: llguidance writes any byte, through the byte tokens)
        engine.generate("Hi", GenerateOptions(max_tokens=4, grammar=Grammar('root ::= "\\x00"', native=True)))
    assert engine.generate("Hi", GenerateOptions(max_tokens=2)).result().tokens  # the engine goes on


PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "pet"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "score": {"type": "number", "minimum": -5, "exclusiveMaximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        "home": {"type": "object", "additionalProperties": False, "required": ["city"],
                 "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "integer", "minimum": 0, "maximum": 999}}},
    },
}


@pytest.mark.slow
def test_json_schema_output_validates(default_model_path):
    """≥ 50 seeded samples at T = 1 on the default model all parse and validate (jsonschema); the
    few that hit max_tokens are counted, and must be rare."""
    import jsonschema  # the test extra installs it
    eng = edgeinfer.load(default_model_path, n_ctx=512, n_threads=1)
    try:
        messages = [{"role": "user", "content": "Invent a person with a pet. Answer in JSON."}]
        by_length, optional_seen = 0, Counter()
        for seed in range(50):
            o = GenerateOptions(max_tokens=64, json_schema=PERSON, sampling=SamplingOptions(temperature=1.0, seed=seed))
            done = eng.chat(messages, o).result()
            if done.finish_reason == "length":
                by_length += 1
                continue
            assert done.finish_reason == "eos"
            obj = json.loads(done.text)
            jsonschema.validate(obj, PERSON)
            optional_seen.update(k for k in ("score", "tags", "home") if k in obj)
        assert by_length <= 5, by_length
        print(f"\n50 samples: {by_length} ended by length; optional fields seen: {dict(optional_seen)}")
    finally:
        eng.close()


@pytest.mark.slow
def test_constrained_greedy_is_the_same_with_lookup_speculation(engine):
    messages = [{"role": "user", "content": "Give a person as JSON with a name, an age and a pet."}]
    plain = engine.chat(messages, GenerateOptions(max_tokens=60, json_schema=PERSON, sampling=SamplingOptions(temperature=0))).result()
    spec = engine.chat(messages, GenerateOptions(max_tokens=60, json_schema=PERSON, sampling=SamplingOptions(temperature=0),
                                                 speculation=edgeinfer.SpeculationOptions(method="lookup"))).result()
    assert spec.tokens == plain.tokens
    json.loads(plain.text)


@pytest.mark.slow
def test_cli_json_schema_and_errors(tmp_path, default_model_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "additionalProperties": False, "required": ["ok"],
                                  "properties": {"ok": {"type": "boolean"}}}))
    cmd = [sys.executable, "-m", "edgeinfer", "run", "--raw", "-n", "20", "--temperature", "1", "--seed", "-3",
           "--presence-penalty", "0.2", "--frequency-penalty", "0.1", "--json", "Is water wet?"]
    out = subprocess.run([*cmd, "--json-schema", str(schema)], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(json.loads(out.stdout)["text"])["ok"] in (True, False)
    bad = subprocess.run([*cmd, "--json-schema", '{"type": "string", "not": {"const": "x"}}'], check=False, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines() == ['edgeinfer: error: JSON schema: Unimplemented keys: ["not"]']
