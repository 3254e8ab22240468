"""Drafting heads (engine/speculation/heads.py): the target's own MTP layer (Qwen3.5) and EAGLE-3
drafters, on tiny random checkpoints converted by our converter.

Lossless: greedy output is token-identical to plain decoding (Engine, and a BatchEngine with 1 and
4 concurrent requests), and at T > 0 the rejection rule keeps the target's distribution (chi-square
of the first three tokens against llama.cpp's chain on the target's logits). The hand-over is
checked against independent numpy passes (tests/numpy_qwen35.py, numpy_eagle3.py): the hidden rows
a head keeps, and the MTP head's first draft. The accounting is tested with a head that always
agrees (acceptance 1 at every position) and a random one (acceptance 0, switched off after a
few tries). Bad input is one line.

"Token-only" models make a head that agrees (hf_models.token_only_mtp): every trunk block's writes
to the residual stream are zero, so the target's next token depends on the current token alone (its
embedding, the final norm, a random output layer); the MTP layer is made to compute exactly that
(fc = [I | 0], its block's writes zero, its final norm the model's), so its logits are the target's
— or, "close", the same with its norm perturbed, so q is near p but not equal (the rejection rule's
two branches both run).
Fixed draft lengths (adaptive=False) make every step draft, whatever this machine's costs say.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import llama_cpp  # noqa: F401 - a hard dependency: missing, these tests fail (never skip)
import numpy as np
import pytest
from greedy_compare import assert_same_or_near_tie
from hf_models import (
    make_random_eagle3_drafter,
    make_random_hf_model,
    make_random_qwen35_model,
    token_only_mtp,
)
from test_core import concurrently  # submitted together, read from threads

import edgeinfer
from edgeinfer import (
    BatchEngine,
    BatchOptions,
    GenerateOptions,
    SamplingOptions,
    SpeculationOptions,
)
from edgeinfer.convert import convert_model
from edgeinfer.errors import InvalidOptionError, SpeculationError

pytestmark = pytest.mark.slow

PROMPTS = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(4)]
N = 40
FIXED = dict(adaptive=False, draft_max=3, p_min=0.0)


def greedy(spec: SpeculationOptions | None = None, n: int = N) -> GenerateOptions:
    return GenerateOptions(max_tokens=n, sampling=SamplingOptions(temperature=0.0),
                           speculation=spec or SpeculationOptions())


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """name -> (f32 GGUF): random Qwen3.5 with MTP (untied, so outputs vary), token-only agreeing /
    close heads, one without an MTP layer, and another random one ("other", a draft model); each
    with its HF folder beside it."""
    root = tmp_path_factory.mktemp("heads")
    out = {}
    variants = {"random": {}, "agree": {"edit": token_only_mtp("agree")}, "close": {"edit": token_only_mtp("close")},
                "no-mtp": {"mtp": False}, "other": {"mtp": False, "seed": 1}}
    for name, kw in variants.items():
        src = make_random_qwen35_model(root / name, tied=False, **kw)
        out[name] = convert_model(src, "f32", root / f"{name}.gguf", register=False).path
    return out


@pytest.fixture(scope="module")
def engines(models):
    """One Engine per model, made on first use, closed at the end of the module."""
    made: dict[str, edgeinfer.Engine] = {}

    def get(name: str) -> edgeinfer.Engine:
        if name not in made:
            made[name] = edgeinfer.load(models[name], n_ctx=1024)
        return made[name]

    yield get
    for e in made.values():
        e.close()


def accounting(sp, tokens) -> None:
    """Every step is a drafting or a plain one; each gives one token plus what it accepted."""
    assert sp.steps + sp.plain_steps + sp.accepted + 1 - len(tokens) in (0, 1), sp
    assert sum(sp.per_position_drafted) == sp.drafted and sum(sp.per_position_accepted) == sp.accepted


# -- MTP: lossless ----------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [SpeculationOptions(method="mtp", **FIXED), SpeculationOptions(method="mtp"),
                                  SpeculationOptions(method="auto")], ids=["fixed", "adaptive", "auto"])
def test_mtp_greedy_output_is_token_identical_to_plain(engines, spec):
    """A random MTP head (nearly every draft rejected: the hybrid target rolls back every step)."""
    engine = engines("random")
    for prompt in PROMPTS[:2]:
        plain = engine.generate(prompt, greedy()).result()
        fast = engine.generate(prompt, greedy(spec)).result()
        assert fast.tokens == plain.tokens
        sp = fast.stats.speculation
        assert sp is not None and sp.method == spec.method
        accounting(sp, fast.tokens)
        if not spec.adaptive:
            assert sp.steps >= N // 2 and sp.drafted >= 3 * (N // 2), sp


def test_mtp_through_a_batch_engine_at_1_and_4_requests(models, engines):
    """Four requests share each step (and each head decode); their outputs are plain's (an f32
    model: batched and one-row logits agree, greedy_compare allows a near-tie only)."""
    single = engines("random")
    plain = [single.generate(p, greedy()).result().tokens for p in PROMPTS]
    spec = SpeculationOptions(method="mtp", **FIXED)
    with BatchEngine.load(models["random"], batch=BatchOptions(parallel=4, calibrate_when_idle=False), n_ctx=1024,
                          speculation="mtp") as be:
        for n in (1, 4):
            done = concurrently(be, PROMPTS[:n], greedy(spec))
            for prompt, reference, d in zip(PROMPTS, plain, done):
                assert d.stats.speculation.drafted > 0
                accounting(d.stats.speculation, d.tokens)
                assert_same_or_near_tie(single, prompt, reference, d.tokens)
        m = be.metrics()
        assert m.drafted > 0 and m.rows > m.steps


@pytest.mark.parametrize("where", ["after_decode", "accept"])
def test_a_head_that_raises_mid_step_turns_off_only_its_requests_speculation(models, engines, where, monkeypatch):
    """Whatever a head raises after a target decode (taking the hidden rows, or following a
    verification) switches off the speculation of the requests it drafts for, which go on plain
    with plain's output and say why; a lookup request beside them and the engine go on."""
    from edgeinfer.engine.speculation.heads import HeadContext

    real = getattr(HeadContext, where)
    calls = []
    fail_at = 12 if where == "after_decode" else 5  # (after every request has drafted: prompts take some decodes)

    def failing(self, *args):
        calls.append(1)
        if len(calls) == fail_at:
            raise SpeculationError(f"the mtp head's cache refused to drop positions (in {where})")
        return real(self, *args)

    single = engines("random")
    plain = [single.generate(p, greedy()).result().tokens for p in PROMPTS[:3]]
    # (patched after the plain runs: an engine cached by an earlier test may carry a head, whose calls
    # would count towards fail_at)
    monkeypatch.setattr(HeadContext, where, failing)
    mtp, lookup = SpeculationOptions(method="mtp", **FIXED), SpeculationOptions(method="lookup", **FIXED)
    with BatchEngine.load(models["random"], batch=BatchOptions(parallel=3, calibrate_when_idle=False), n_ctx=1024,
                          speculation="mtp") as be:
        gens = [be.submit(p, greedy(spec)) for p, spec in zip(PROMPTS, (mtp, mtp, lookup))]
        done = [g.result() for g in gens]
        assert len(calls) > fail_at
        for prompt, reference, d in zip(PROMPTS, plain, done):
            assert_same_or_near_tie(single, prompt, reference, d.tokens)
        off = [d for d in done[:2] if "speculation off" in d.stats.speculation.note and where in d.stats.speculation.note]
        # a head's hand-over fails for every request it drafts for; following a verification, for that one
        assert len(off) == (2 if where == "after_decode" else 1), [d.stats.speculation for d in done]
        assert all(d.stats.speculation.drafted > 0 for d in done[:2])
        assert done[2].stats.speculation.note == ""
        assert be.failure is None and "error" not in be.metrics().requests_finished
        again = be.submit(PROMPTS[0], greedy(mtp)).result()  # the head drafts again (reset)
        assert again.tokens == plain[0] and again.stats.speculation.drafted > 0


def test_mtp_head_sees_the_targets_hidden_states_and_drafts_what_numpy_says(models, monkeypatch):
    """White-box, on a BatchEngine with two concurrent requests: the rows the head kept for each
    slot are the target's final hidden states at those positions (numpy), and each first drafted
    token is the argmax of numpy's MTP logits for (the last token, the hidden state before it)."""
    from numpy_qwen35 import Qwen35Reference

    from edgeinfer.engine.speculation.heads import HeadContext

    drafts: list[tuple[list[int], int]] = []
    real = HeadContext.draft

    def recording(self, jobs):
        real(self, jobs)
        drafts.extend((list(j.history), j.tokens[0]) for j in jobs if j.tokens)

    monkeypatch.setattr(HeadContext, "draft", recording)
    ref = Qwen35Reference(models["random"].parent / "random")
    spec = SpeculationOptions(method="mtp", **FIXED)
    with BatchEngine.load(models["random"], batch=BatchOptions(parallel=2, calibrate_when_idle=False), n_ctx=512,
                          kv_type="f32", flash_attn=False, speculation="mtp") as be:  # numpy at 1e-4
        concurrently(be, PROMPTS[:2], greedy(spec, 12))
        head = be._drafts.heads()[0]
        worst = 0.0
        for s in range(2):
            known = list(head._known[s])
            assert len(known) >= len(PROMPTS[0])
            worst = max(worst, float(np.abs(head._rows[s][: len(known)] - ref.hidden(known)).max()))
    assert worst < 1e-4, worst
    assert len(drafts) >= 10
    for history, first in drafts[:6]:
        h = ref.hidden(history)  # rows 0..len-2 are the target's; h[p-1] rides beside token p
        want = ref.mtp_logits(history, h)[-1]
        top2 = np.sort(want)[-2:]
        assert first == int(want.argmax()) or top2[1] - top2[0] < 1e-3
    print(f"mtp: kept hidden rows max|Δ| {worst:.3g}; {len(drafts)} first drafts checked against numpy")


# -- MTP: accounting and policy -----------------------------------------------------------------------
def test_a_head_that_agrees_is_accepted_at_every_position(engines):
    engine = engines("agree")
    plain = engine.generate(PROMPTS[0], greedy()).result()
    fast = engine.generate(PROMPTS[0], greedy(SpeculationOptions(method="mtp", **FIXED))).result()
    assert fast.tokens == plain.tokens
    sp = fast.stats.speculation
    accounting(sp, fast.tokens)
    assert sp.acceptance_rate >= 0.95 and min(sp.per_position_acceptance) >= 0.9, sp.to_dict()
    assert sp.mean_accepted_len >= 2.7 and sp.steps <= N // 3, sp.to_dict()  # three drafts, each kept
    assert sp.draft_cost > 0


def test_a_random_head_is_rejected_and_switched_off(engines):
    """Adaptive: a few tries, every one rejected (or none, where its cost alone rules it out), then
    plain steps: it drafts nothing after its first tries, so it costs no more than that."""
    engine = engines("random")
    done = engine.generate(PROMPTS[2], greedy(SpeculationOptions(method="mtp"), n=120)).result()
    sp = done.stats.speculation
    accounting(sp, done.tokens)
    assert sp.accepted <= 1 and sp.steps <= 6 and sp.plain_steps >= 110, sp.to_dict()
    fixed = engine.generate(PROMPTS[2], greedy(SpeculationOptions(method="mtp", **FIXED), n=60)).result().stats
    assert fixed.speculation.acceptance_rate < 0.05, fixed.speculation.to_dict()


# -- MTP: the rejection rule at T > 0 ----------------------------------------------------------------
def test_mtp_rejection_rule_keeps_the_targets_distribution(engines):
    """A head whose q is near the target's p but not equal (accepted often, rejected at times),
    drafting three tokens every step at T = 0.5: chi-square of the first three tokens over 100 seeds."""
    from sequence_chi_square import check_rejection_rule

    engine = engines("close")
    prompt = PROMPTS[1]
    sampling = SamplingOptions(temperature=0.5)
    # n = 100: the fewest runs that give three cells expected >= 5 times (60 give fewer); at alpha = 1e-3
    # the chi-square rejects the first three tokens drawn at twice the temperature (w = 0.57) with
    # power 0.93 (sequence_chi_square.chi_square_power).
    drafted, accepted = check_rejection_rule(engine, prompt, sampling, SpeculationOptions(method="mtp", **FIXED),
                                             100, 3, "mtp")
    assert 0 < accepted < drafted, (drafted, accepted)


# -- hybrid rollback ---------------------------------------------------------------------------------
def test_hybrid_target_rolls_back_within_its_snapshots_and_refuses_beyond(engines):
    """Lookup on the hybrid model drafts now (its context keeps rollback snapshots); a suffix longer
    than the snapshots is refused in one line, never handed to llama.cpp."""
    from edgeinfer.engine.speculation.heads import ROLLBACK_DEPTH

    engine = engines("agree")  # token-only: after any prefix ending in t comes f(t), the chain
    chain = [500] + engine.generate([500], greedy()).result().tokens
    # The chain again, once with a wrong token in it, then its start: lookup drafts the chain and
    # the wrong token, which is rejected — a rollback of the hybrid memory.
    prompt = chain[:12] + [7] + chain[13:30] + chain[:5]
    plain = engine.generate(prompt, greedy()).result()
    fast = engine.generate(prompt, greedy(SpeculationOptions(method="lookup", **FIXED))).result()
    sp = fast.stats.speculation
    assert fast.tokens == plain.tokens
    assert sp.method == "lookup" and sp.drafted > 0 and 0 < sp.accepted < sp.drafted, sp.to_dict()
    rt = engine._runtime
    assert rt.facts.recurrent and rt.n_rs_seq == ROLLBACK_DEPTH
    with engine._slot.hold():
        seq = engine._scheduler.slots[0].seq
        seq.clear()
        seq.decode(list(range(200, 200 + ROLLBACK_DEPTH + 3)))
        with pytest.raises(SpeculationError, match="rolls back 4 positions, not 6") as e:
            seq.drop_suffix(1)
        assert "\n" not in str(e.value)
        seq.drop_suffix(len(seq) - ROLLBACK_DEPTH)  # within the snapshots: fine
        assert len(seq) == 3


@pytest.mark.parametrize("draft", ["itself", "other", "self=Q8_0"])
def test_a_draft_model_on_a_hybrid_target_keeps_greedy_output_on_both_faces(models, draft):
    """A draft model (the target itself, another random Qwen3.5) or a self-draft on a hybrid target,
    drafting three tokens every step: greedy output is plain's, on an Engine and on a BatchEngine
    with two requests. (The draft's cost probe after the first token once removed its probe token
    with a cut the hybrid memory cannot make: the whole prompt went with it.)"""
    if draft.startswith("self="):
        spec = SpeculationOptions(method="self", self_quant=draft.partition("=")[2], **FIXED)
    else:
        spec = SpeculationOptions(method="draft", draft_model=str(models["random" if draft == "itself" else draft]),
                                  **FIXED)
    with edgeinfer.load(models["random"], n_ctx=1024) as engine:
        plain = [engine.generate(p, greedy()).result().tokens for p in PROMPTS[:2]]
        engine.prepare_speculation(spec)
        for prompt, reference in zip(PROMPTS[:2], plain):
            fast = engine.generate(prompt, greedy(spec)).result()
            assert fast.tokens == reference
            assert fast.stats.speculation.drafted >= N // 2, fast.stats.speculation.to_dict()  # a draft every step
            accounting(fast.stats.speculation, fast.tokens)
        with BatchEngine.load(models["random"], batch=BatchOptions(parallel=2, calibrate_when_idle=False), n_ctx=1024,
                              speculation=spec) as be:
            for prompt, reference, d in zip(PROMPTS, plain, concurrently(be, PROMPTS[:2], greedy(spec))):
                assert d.stats.speculation.drafted >= N // 2, d.stats.speculation.to_dict()
                assert_same_or_near_tie(engine, prompt, reference, d.tokens)


def test_the_cost_curve_of_a_hybrid_target_is_timed_at_the_depths_asked(engines, monkeypatch):
    """measure_decode_costs (edgeinfer bench's curve): every size is timed right after exactly the
    context depth it is for, also on a hybrid target, whose memory cannot drop what a decode
    appended (the sequence is filled again; cutting it emptied it, and every later size was timed
    at depth 0)."""
    from edgeinfer.engine.core.sequence import KVSequence
    from edgeinfer.engine.speculation.policy import CALIBRATION_SIZES

    seen: list[tuple[int, int]] = []  # (tokens the sequence held, tokens decoded) of each decode
    real = KVSequence.decode

    def decode(self, tokens, logits_from=None):
        seen.append((len(self.cached), len(tokens)))
        return real(self, tokens, logits_from)

    monkeypatch.setattr(KVSequence, "decode", decode)
    engine = engines("no-mtp")
    assert engine._runtime.facts.recurrent
    costs = engine.measure_decode_costs(list(range(100, 400)), depths=(16, 96), reps=1, save=False)
    for depth in (16, 96):
        assert {n for d, n in seen if d == depth} >= set(CALIBRATION_SIZES), (depth, seen)
    assert costs.t1 > 0 and costs.attention >= 0
    assert len(engine._scheduler.slots[0].seq) == 0  # cleared after


def test_a_batch_engine_without_rollback_says_why_it_does_not_speculate(models):
    with BatchEngine.load(models["random"], batch=BatchOptions(parallel=2, calibrate_when_idle=False),
                          n_ctx=512) as be:
        done = be.generate(PROMPTS[0], greedy(SpeculationOptions(method="lookup"), 4)).result()
        assert "no rollback snapshots" in done.stats.speculation.note
        with pytest.raises(SpeculationError, match="must be chosen when the engine is made"):
            be.prepare_speculation("mtp")


# -- bad input ---------------------------------------------------------------------------------------
def test_mtp_on_a_model_without_an_mtp_layer_is_one_line(engines, default_model_path):
    assert not engines("no-mtp").has_mtp and engines("agree").has_mtp  # (what the chat's panel offers by)
    with pytest.raises(SpeculationError) as e:
        engines("no-mtp").prepare_speculation("mtp")
    assert "has no MTP layer" in str(e.value) and "qwen35" in str(e.value) and "\n" not in str(e.value)
    cli = subprocess.run([sys.executable, "-m", "edgeinfer", "run", str(default_model_path), "-p", "Hi",
                          "--speculate", "mtp", "--max-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1 and "has no MTP layer" in cli.stderr and "a llama model" in cli.stderr, cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr


def test_head_options_parse_and_refuse():
    assert SpeculationOptions.parse("mtp").method == "mtp"
    e3 = SpeculationOptions.parse("eagle3=drafter.gguf")
    assert (e3.method, e3.draft_model) == ("eagle3", "drafter.gguf")
    for bad, words in (("eagle3", "eagle3=MODEL"), ("mtp=x", "takes no argument")):
        with pytest.raises(InvalidOptionError, match=words):
            SpeculationOptions.parse(bad)


def test_another_binding_is_a_clear_error_not_a_crash():
    """A llama-cpp-python of another llama.cpp (here: one whose library lacks the mangled symbols
    and whose structs lack the fields) is refused by name before anything is called."""
    from edgeinfer.engine.llama.heads_api import HeadAPI

    class Struct:
        _fields_ = [("n_ctx", int)]

    fake = type("ll", (), {"llama_model_params": Struct, "llama_context_params": Struct, "_lib": {},
                           "__version__": "0.3.99"})()
    with pytest.raises(SpeculationError) as e:
        HeadAPI(fake)
    assert "0.3.36" in str(e.value) and "0.3.99" in str(e.value) and "\n" not in str(e.value)


def test_server_requests_may_use_the_servers_head():
    from server.errors import APIError
    from server.protocol import _speculation

    mtp = SpeculationOptions(method="mtp")
    assert _speculation({"speculation": "mtp"}, mtp) == mtp
    assert _speculation({"speculation": {"method": "mtp", "draft_max": 2}}, mtp).draft_max == 2
    with pytest.raises(APIError, match="--speculate mtp"):
        _speculation({"speculation": "mtp"}, SpeculationOptions(method="lookup"))


# -- EAGLE-3 -----------------------------------------------------------------------------------------
AUX = [1, 4, 6]


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory):
    """(target folder, drafter folder, target GGUF, drafter GGUF, Engine on the target)."""
    root = tmp_path_factory.mktemp("eagle3-heads")
    target = make_random_hf_model(root / "Qwen3-tiny", "qwen3", layers=8, heads=4, kv_heads=2, tied=False)
    drafter = make_random_eagle3_drafter(root / "Qwen3-tiny-eagle3", target, aux_layers=AUX)
    t = convert_model(target, "f32", root / "target.gguf", register=False).path
    d = convert_model(drafter, "f32", root / "drafter.gguf", register=False, target=target).path
    # An f32 cache and no flash attention (its f16 accumulation is ~3e-4 off): numpy comparisons at 1e-4.
    engine = edgeinfer.load(t, n_ctx=1024, kv_type="f32", flash_attn=False)
    yield target, drafter, t, d, engine
    engine.close()


def test_eagle3_greedy_output_is_token_identical_on_both_faces(eagle3):
    target, drafter, t, d, engine = eagle3
    spec = SpeculationOptions(method="eagle3", draft_model=str(d), **FIXED)
    plain = [engine.generate(p, greedy()).result().tokens for p in PROMPTS]
    for prompt, reference in zip(PROMPTS[:2], plain):
        fast = engine.generate(prompt, greedy(spec)).result()
        assert fast.tokens == reference
        assert fast.stats.speculation.method == "eagle3" and fast.stats.speculation.drafted >= N
        accounting(fast.stats.speculation, fast.tokens)
    with BatchEngine.load(t, batch=BatchOptions(parallel=4, calibrate_when_idle=False), n_ctx=1024, kv_type="f32",
                          flash_attn=False, speculation=f"eagle3={d}") as be:
        assert be.kv_unified  # a head reads hidden states by batch row: one cache
        for n in (1, 4):
            done = concurrently(be, PROMPTS[:n], greedy(spec))
            for prompt, reference, r in zip(PROMPTS, plain, done):
                assert r.stats.speculation.drafted > 0
                assert_same_or_near_tie(engine, prompt, reference, r.tokens)
        head = be._drafts.heads()[0]
        head._ready(0)  # the last rows may still wait for the encoder
        known = list(head._known[0])
        g = head._rows[0][: len(known)].copy()
    # The fused features the head kept are the EAGLE-3 encoder's output on the target's layer inputs.
    from numpy_eagle3 import eagle3_features
    from numpy_reference import forward_logits

    layer_inputs: list[np.ndarray] = []
    forward_logits(target, known, layer_inputs=layer_inputs)
    want = eagle3_features(drafter, np.concatenate([layer_inputs[i] for i in AUX], axis=1))
    err = float(np.abs(g - want).max())
    print(f"eagle3: kept features max|Δ| {err:.3g} over {len(known)} positions")
    assert err < 1e-4


def test_eagle3_rejection_rule_keeps_the_targets_distribution(eagle3):
    from sequence_chi_square import check_rejection_rule

    *_, d, engine = eagle3
    prompt = PROMPTS[2]
    sampling = SamplingOptions(temperature=0.3)  # this target's first tokens spread over six likely sequences
    # n = 100: at alpha = 1e-3 the chi-square rejects the first three tokens drawn at twice the
    # temperature (w = 0.91) with power 1.0 (60 runs: 0.86; sequence_chi_square.chi_square_power).
    # A random drafter: its q and the target's p barely overlap (rejections).
    check_rejection_rule(engine, prompt, sampling, SpeculationOptions(method="eagle3", draft_model=str(d), **FIXED),
                         100, 3, "eagle3")


def test_eagle3_refuses_what_is_not_its_drafter_in_one_line(eagle3, models):
    *_, d, engine = eagle3
    with pytest.raises(edgeinfer.IncompatibleDraftError, match="is not an EAGLE-3 drafter"):
        engine.prepare_speculation(f"eagle3={models['random']}")
    with edgeinfer.load(models["random"], n_ctx=256) as qwen35:  # 4 layers: the drafter reads layer 6
        with pytest.raises(edgeinfer.IncompatibleDraftError, match="has 4 layers") as e:
            qwen35.prepare_speculation(f"eagle3={d}")
    assert "\n" not in str(e.value)
