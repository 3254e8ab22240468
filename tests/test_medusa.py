"""Medusa heads drafting (engine/speculation/medusa.py) on a tiny random qwen3 target (f32, so
batched and one-row logits agree), with heads converted by our converter (convert/medusa.py).

Two sets of heads: random ones (nearly every draft rejected) and heads constructed to agree with
the target (tests/medusa_heads.fit_heads_to: their projections solved so that, on the target's own
greedy continuations of PROMPTS, head i's top token at each position is the one the target
produces i + 2 tokens later). Lossless: greedy output is token-identical to plain on an Engine and
a BatchEngine at 1, 4 and 8 concurrent requests; at T > 0 the rejection rule keeps the target's
distribution (chi-square of the first three tokens). An agreeing head is accepted at every
position; a random one is switched off by the adaptive policy. What the heads read and compute is
checked against an independent numpy pass (the target's post-norm state, the heads' logits).
Fixed draft lengths (adaptive=False) make every step draft, whatever this machine's costs say.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import llama_cpp  # noqa: F401 - a hard dependency: missing, these tests fail (never skip)
import numpy as np
import pytest
from greedy_compare import assert_same_or_near_tie
from hf_models import make_random_hf_model
from medusa_heads import fit_heads_to, make_random_medusa_heads, medusa_reference, target_hidden
from test_core import concurrently  # submitted together, read from threads
from test_heads import accounting

import edgeinfer
from edgeinfer import BatchEngine, BatchOptions, GenerateOptions, SamplingOptions, SpeculationOptions
from edgeinfer.convert import convert_model
from edgeinfer.errors import IncompatibleDraftError, InvalidOptionError

pytestmark = pytest.mark.slow

PROMPTS = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(8)]
# A prompt short enough that its decode keeps its hidden states (medusa.py: at most 8 rows without
# output), so the heads draft from the first step: the chi-square's first three tokens go through the rule.
SHORT = PROMPTS[1][-6:]
N = 24  # 9 prompts x ~23 fitted positions stay below the 256 hidden dimensions (an exact fit)
HEADS = 3
FIXED = dict(adaptive=False, draft_max=HEADS, p_min=0.0)


def greedy(spec: SpeculationOptions | None = None, n: int = N) -> GenerateOptions:
    return GenerateOptions(max_tokens=n, sampling=SamplingOptions(temperature=0.0),
                           speculation=spec or SpeculationOptions())


@pytest.fixture(scope="module")
def medusa(tmp_path_factory):
    """dict: target folder and GGUF, random / agreeing heads (folders and GGUFs), an Engine on the
    target and its plain greedy outputs of PROMPTS."""
    root = tmp_path_factory.mktemp("medusa")
    target = make_random_hf_model(root / "Qwen3-tiny", "qwen3", layers=2, heads=4, kv_heads=2, tied=False)
    t = convert_model(target, "f32", root / "target.gguf", register=False).path
    rand = make_random_medusa_heads(root / "heads-random", target, n_heads=HEADS)
    engine = edgeinfer.load(t, n_ctx=1024, kv_type="f32", flash_attn=False)
    plain = [engine.generate(p, greedy()).result().tokens for p in PROMPTS]
    short = engine.generate(SHORT, greedy()).result().tokens
    agree = Path(shutil.copytree(rand, root / "heads-agree"))
    fit_heads_to(agree, target, [p + q for p, q in zip(PROMPTS + [SHORT], plain + [short])],
                 [len(p) for p in PROMPTS + [SHORT]], margin=8.0)
    out = dict(target=target, t=t, random=rand, agree=agree, engine=engine, plain=plain,
               random_gguf=convert_model(rand, "f32", root / "random.gguf").path,
               agree_gguf=convert_model(agree, "f32", root / "agree.gguf").path)
    yield out
    engine.close()


def spec_of(path: Path, **kw) -> SpeculationOptions:
    return SpeculationOptions(method="medusa", draft_model=str(path), **kw)


@pytest.mark.parametrize("heads", ["random", "agree"])
def test_greedy_output_is_token_identical_to_plain_on_an_engine(medusa, heads):
    engine = medusa["engine"]
    for prompt, reference in zip(PROMPTS[:2], medusa["plain"]):
        fast = engine.generate(prompt, greedy(spec_of(medusa[f"{heads}_gguf"], **FIXED))).result()
        assert fast.tokens == reference
        sp = fast.stats.speculation
        assert sp.method == "medusa" and sp.drafted >= N // 2, sp.to_dict()
        assert len(sp.per_position_drafted) <= HEADS  # a token per head at most
        accounting(sp, fast.tokens)


@pytest.mark.parametrize("heads", ["random", "agree"])
def test_greedy_output_is_plain_at_1_4_and_8_concurrent_requests(medusa, heads):
    """Eight slots share each step and each heads evaluation (one matrix product per head for all
    the requests that draft that far)."""
    spec = spec_of(medusa[f"{heads}_gguf"], **FIXED)
    with BatchEngine.load(medusa["t"], batch=BatchOptions(parallel=8, calibrate_when_idle=False), n_ctx=1024,
                          kv_type="f32", flash_attn=False, speculation=spec) as be:
        assert be.kv_unified
        for n in (1, 4, 8):
            done = concurrently(be, PROMPTS[:n], greedy(spec))
            for prompt, reference, d in zip(PROMPTS, medusa["plain"], done):
                sp = d.stats.speculation
                assert sp.drafted > 0, sp.to_dict()
                accounting(sp, d.tokens)
                assert_same_or_near_tie(medusa["engine"], prompt, reference, d.tokens)
                if heads == "agree":
                    assert d.tokens == reference and sp.acceptance_rate == 1.0, sp.to_dict()
        m = be.metrics()
        assert m.drafted > 0 and m.rows > m.steps


def test_an_agreeing_head_is_accepted_at_every_position(medusa):
    engine = medusa["engine"]
    fast = engine.generate(PROMPTS[3], greedy(spec_of(medusa["agree_gguf"], **FIXED))).result()
    assert fast.tokens == medusa["plain"][3]
    sp = fast.stats.speculation
    accounting(sp, fast.tokens)
    assert sp.acceptance_rate == 1.0 and len(sp.per_position_acceptance) == HEADS, sp.to_dict()
    assert sp.mean_accepted_len >= 2.5 and sp.steps <= N // 3 + 1, sp.to_dict()  # three drafts, each kept
    assert sp.draft_cost > 0


def test_a_random_head_is_rejected_and_switched_off(medusa):
    """Adaptive: a few tries, every one rejected (or none, where its cost alone rules it out on this
    tiny target: a head's projection is as large as the target's output layer), then plain steps."""
    engine = medusa["engine"]
    done = engine.generate(PROMPTS[2], greedy(spec_of(medusa["random_gguf"]), n=120)).result()
    sp = done.stats.speculation
    accounting(sp, done.tokens)
    assert sp.accepted <= 1 and sp.steps <= 6 and sp.plain_steps >= 110, sp.to_dict()
    fixed = engine.generate(PROMPTS[2], greedy(spec_of(medusa["random_gguf"], **FIXED), n=60)).result().stats
    assert fixed.speculation.acceptance_rate < 0.05, fixed.speculation.to_dict()


def test_rejection_rule_keeps_the_targets_distribution(medusa):
    """Agreeing heads sampled at T = 0.5 (q is peaked on the target's greedy continuation, p is not:
    both branches of the rule run), three tokens drafted every step: chi-square of the first three
    tokens over 100 seeds against llama.cpp's chain on the target's logits."""
    from sequence_chi_square import check_rejection_rule

    # n = 100: at alpha = 1e-3 the chi-square rejects the first three tokens drawn at twice the
    # temperature (w = 0.64) with power 0.995 (sequence_chi_square.chi_square_power on SHORT; at 60
    # runs too few sequences keep 5 expected counts for three cells).
    drafted, accepted = check_rejection_rule(medusa["engine"], SHORT, SamplingOptions(temperature=0.5),
                                             spec_of(medusa["agree_gguf"], **FIXED), 100, 3, "medusa")
    assert 0 < accepted < drafted, (drafted, accepted)


def test_heads_read_the_targets_post_norm_state_and_compute_what_numpy_says(medusa, caplog):
    """The rows the heads keep are the target's final hidden state after its norm at each output row
    (numpy reference), and the heads' logits on them are the published heads' (numpy, float64). A
    prompt's rows are not kept (llama.cpp would output every one of them: it never has to)."""
    from edgeinfer.engine.speculation.medusa import MedusaWeights
    from edgeinfer.gguf_file import read_gguf

    with BatchEngine.load(medusa["t"], batch=BatchOptions(parallel=2, calibrate_when_idle=False), n_ctx=512,
                          kv_type="f32", flash_attn=False, speculation=spec_of(medusa["random_gguf"])) as be:
        with caplog.at_level("DEBUG"):
            be.submit(PROMPTS[0], greedy(spec_of(medusa["random_gguf"], **FIXED), n=8)).result()
        head = be._drafts.heads()[0]
        known = list(head._known[0])
        rows = head._rows[0][: len(known)].copy()
    assert "overriding" not in caplog.text  # llama.cpp's word when it outputs rows nobody asked for
    kept = np.isfinite(rows).all(1)
    p = len(PROMPTS[0])
    assert not kept[:p].any() and kept[p:].sum() >= 6, kept  # verified rows only
    want = target_hidden(medusa["target"], known)
    err = float(np.abs(rows[kept] - want[kept]).max())
    weights = MedusaWeights(medusa["random_gguf"], read_gguf(medusa["random_gguf"]))
    got = np.stack([weights.logits(i, want[kept].astype(np.float32)) for i in range(HEADS)])
    ref = medusa_reference(medusa["random"], want[kept])
    l_err = float(np.abs(got - ref).max())
    print(f"medusa: kept states max|Δ| {err:.3g} over {kept.sum()} rows, head logits {l_err:.3g} "
          f"(scale {np.abs(ref).max():.3g})")
    assert err < 1e-4 and l_err < 1e-3
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_medusa_refuses_what_is_not_its_heads_in_one_line(medusa, tmp_path):
    engine = medusa["engine"]
    with pytest.raises(IncompatibleDraftError, match="is not a file of Medusa heads") as e:
        engine.prepare_speculation(f"medusa={medusa['t']}")
    assert "\n" not in str(e.value)
    other = make_random_hf_model(tmp_path / "wide", "qwen3", layers=1, hidden=512, heads=4, kv_heads=2, tied=False)
    wide = convert_model(make_random_medusa_heads(tmp_path / "wide-heads", other, n_heads=1), "f16",
                         tmp_path / "wide.gguf").path
    with pytest.raises(IncompatibleDraftError, match="512 wide"):
        engine.prepare_speculation(f"medusa={wide}")
    with pytest.raises(InvalidOptionError, match="a file of Medusa heads"):
        SpeculationOptions.parse("medusa")
    assert SpeculationOptions.parse(f"medusa={wide}").draft_model == str(wide)


def test_llama_cpp_sequence_ids_express_a_token_tree(medusa):
    """What a token tree would need (benchmarks/RESULTS.md says why this CPU verifies chains): a row
    may belong to several sequences, and each sequence attends only to its own cells, so a tree is
    one sequence id per root-to-leaf path, shared nodes carrying all of theirs. One decode of the
    tree [A -> (B -> D), (C)] gives each node the logits of its own chain, and keeping branch C
    (seq_cp / seq_rm) leaves the slot's sequence as if A, C had been decoded alone."""
    from llama_ext import ext

    ll = ext().ll
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = ll.llama_model_load_from_file(str(medusa["t"]).encode(), mp)
    cp = ll.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 256
    cp.n_seq_max, cp.kv_unified, cp.flash_attn_type = 2, True, 0
    cp.type_k = cp.type_v = 0  # f32
    cp.n_threads = cp.n_threads_batch = 1
    ctx = ll.llama_init_from_model(model, cp)
    mem = ll.llama_get_memory(ctx)

    def decode(rows: list[tuple[int, int, list[int]]]) -> list[np.ndarray]:
        b = ll.llama_batch_init(len(rows), 0, 2)
        for i, (tok, pos, seqs) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, len(seqs), True
            for j, s in enumerate(seqs):
                b.seq_id[i][j] = s
        b.n_tokens = len(rows)
        try:
            assert ll.llama_decode(ctx, b) == 0
            return [np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(49152,)).copy()
                    for i in range(len(rows))]
        finally:
            ll.llama_batch_free(b)

    try:
        prompt, (A, B, C, D) = PROMPTS[0], (500, 600, 700, 800)
        p = len(prompt)
        decode([(t, i, [0]) for i, t in enumerate(prompt)])
        ab, abd = decode([(A, p, [0]), (B, p + 1, [0]), (D, p + 2, [0])])[1:]
        ll.llama_memory_seq_rm(mem, 0, p, -1)
        ac = decode([(A, p, [0]), (C, p + 1, [0])])[1]
        ll.llama_memory_seq_rm(mem, 0, p, -1)
        ll.llama_memory_seq_cp(mem, 0, 1, -1, -1)
        tree = decode([(A, p, [0, 1]), (B, p + 1, [0]), (C, p + 1, [1]), (D, p + 2, [0])])
        for got, want in ((tree[1], ab), (tree[2], ac), (tree[3], abd)):
            assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
        assert ll.llama_memory_seq_rm(mem, 0, p, -1)  # keep branch C as the slot's sequence
        ll.llama_memory_seq_cp(mem, 1, 0, -1, -1)
        assert ll.llama_memory_seq_rm(mem, 1, -1, -1)
        after = decode([(D, p + 2, [0])])[0]
        ll.llama_memory_seq_rm(mem, 0, p, -1)
        want = decode([(A, p, [0]), (C, p + 1, [0]), (D, p + 2, [0])])[2]
        assert np.abs(after - want).max() < 1e-4 * np.abs(want).max()
    finally:
        ll.llama_free(ctx)
        ll.llama_model_free(model)
