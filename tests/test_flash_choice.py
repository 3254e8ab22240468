"""Flash attention chosen by timing it on and off (engine/llama/flash_choice.py): the verdict's rule, its
measurement on the real default model, the store's verdict at the next load, and what it must not
override (the user's setting, a quantized V cache, another thread count, a hostile store entry)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer import FlashAttnChoice, Store
from edgeinfer.engine.llama.flash_choice import MARGIN, TURN_TOKENS, remember_flash_attn, verdict_key, with_measured_flash_attn
from edgeinfer.engine.core.options import LoadOptions


def _choice(decode_on: float, decode_off: float, prefill_on: float = 1.0, prefill_off: float = 1.0) -> FlashAttnChoice:
    return FlashAttnChoice(depth=512, prefill_on_s=prefill_on, prefill_off_s=prefill_off, decode_on_s=decode_on,
                           decode_off_s=decode_off)


def test_the_verdict_weighs_a_whole_turn_and_keeps_llama_cpps_default_unless_off_clearly_wins():
    # The 135M as measured here: decode 37.7 vs 69.5 tok/s at depth 512, prefill 190 vs 177 tok/s.
    small = _choice(1 / 37.7, 1 / 69.5, 512 / 190, 512 / 177)
    assert small.turn_s(True) == pytest.approx(512 / 190 + TURN_TOKENS / 37.7)
    assert small.flash_attn is False
    # The 1.5B at depth 512 (llama-bench): decode 13.24 vs 13.64, prefill 82 vs 66 tok/s: the prefill decides.
    assert _choice(1 / 13.24, 1 / 13.64, 512 / 82, 512 / 66).flash_attn is True
    # Off a little faster, within the margin: llama.cpp's choice (on) stands.
    on = 0.010
    just_inside = on * (1 - MARGIN * 0.5)
    assert _choice(on, just_inside, 0.0001, 0.0001).flash_attn is True
    assert _choice(on, on * (1 - MARGIN * 2), 0.0001, 0.0001).flash_attn is False
    assert "off" in small.summary() and "37.7 tok/s on vs 69.5 off" in small.summary()


@pytest.mark.parametrize("bad", [
    None, "fast", [1, 2], {"depth": 512}, {"depth": True, "prefill_on_s": 1, "prefill_off_s": 1, "decode_on_s": 1,
                                         "decode_off_s": 1},
    {"depth": 512, "prefill_on_s": 1, "prefill_off_s": 1, "decode_on_s": math.nan, "decode_off_s": 1},
    {"depth": 512, "prefill_on_s": 1, "prefill_off_s": -1, "decode_on_s": 1, "decode_off_s": 1},
    {"depth": 512, "prefill_on_s": 1, "prefill_off_s": 1, "decode_on_s": "1", "decode_off_s": 1},
])
def test_a_hostile_store_entry_is_no_verdict(default_model_path: Path, bad: object):
    store = Store()
    options = LoadOptions(n_threads=2)
    remember_flash_attn(default_model_path, options, store, _choice(0.02, 0.01))
    assert with_measured_flash_attn(default_model_path, options, store).flash_attn is False
    # the entry replaced by something hostile: no verdict, llama.cpp's own choice, and a load still works
    store.write_cache("flash-attn", verdict_key(default_model_path, options), bad)
    assert with_measured_flash_attn(default_model_path, options, store).flash_attn is None


@pytest.mark.slow
def test_a_measured_verdict_is_used_by_the_next_load_and_overrides_nothing_the_user_set(default_model_path: Path):
    with edgeinfer.load(n_ctx=512, n_threads=2) as engine:
        assert engine.options.flash_attn is None  # nothing measured yet: llama.cpp's choice
        tokens = engine.tokenize("def add(a, b):\n    return a + b\n" * 20, add_special=True)[:96]
        choice = engine.measure_flash_attn(tokens, steps=4)
        assert choice.depth == 96
        assert min(choice.prefill_on_s, choice.prefill_off_s, choice.decode_on_s, choice.decode_off_s) > 0
        # a step after 96 tokens costs less than their prefill, with either setting
        assert choice.decode_on_s < choice.prefill_on_s and choice.decode_off_s < choice.prefill_off_s
        # the engine still generates after the scratch contexts are gone
        assert engine.generate("Hello", edgeinfer.GenerateOptions(max_tokens=4)).result().stats.generated_tokens > 0
        with pytest.raises(edgeinfer.InvalidOptionError, match="prompt tokens"):
            engine.measure_flash_attn([], steps=4)
        with pytest.raises(edgeinfer.InvalidOptionError, match="prompt tokens"):
            engine.measure_flash_attn(tokens * 10, steps=4)  # more than the context holds
        with pytest.raises(edgeinfer.InvalidOptionError):
            engine.measure_flash_attn([10**9], steps=4)

    with edgeinfer.load(n_ctx=512, n_threads=2) as engine:
        assert engine.options.flash_attn is choice.flash_attn
    # Each verdict is for a thread count; the user's setting and a quantized V cache are not ours to change.
    store = Store()
    for verdict in (_choice(0.02, 0.01), _choice(0.01, 0.02)):
        remember_flash_attn(default_model_path, LoadOptions(n_threads=2), store, verdict)
        with edgeinfer.load(n_ctx=512, n_threads=2) as engine:
            assert engine.options.flash_attn is verdict.flash_attn
            text = engine.generate("Hello", edgeinfer.GenerateOptions(max_tokens=4)).result().text
            assert text
        with edgeinfer.load(n_ctx=512, n_threads=1) as engine:
            assert engine.options.flash_attn is None
        with edgeinfer.load(n_ctx=512, n_threads=2, flash_attn=True) as engine:
            assert engine.options.flash_attn is True
        with edgeinfer.load(n_ctx=512, n_threads=2, kv_type="q8_0") as engine:
            assert engine.options.flash_attn is None  # (llama.cpp turns it on for the quantized V cache)


def test_the_servers_engine_takes_the_verdict_with_a_stream_per_slot_only(default_model_path: Path):
    """A BatchEngine's rows each attend over their own slot's stream, as one sequence's do, so the
    measured verdict holds there; with one cache for every slot (kv_unified) it is not ours to use."""
    store = Store()
    for verdict in (_choice(0.02, 0.01), _choice(0.01, 0.02)):
        remember_flash_attn(default_model_path, LoadOptions(n_threads=2), store, verdict)
        batch = edgeinfer.BatchOptions(parallel=2, calibrate_when_idle=False)
        with edgeinfer.BatchEngine.load(batch=batch, n_ctx=512, n_threads=2) as be:
            assert be.options.flash_attn is verdict.flash_attn
            done = be.generate("Hello", edgeinfer.GenerateOptions(max_tokens=4)).result()
            assert done.stats.generated_tokens > 0
        unified = edgeinfer.BatchOptions(parallel=2, calibrate_when_idle=False, kv_unified=True)
        with edgeinfer.BatchEngine.load(batch=unified, n_ctx=512, n_threads=2) as be:
            assert be.options.flash_attn is None
        with edgeinfer.BatchEngine.load(batch=batch, n_ctx=512, n_threads=2, flash_attn=True) as be:
            assert be.options.flash_attn is True
