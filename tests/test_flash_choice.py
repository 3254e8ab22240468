"""Flash attention chosen by timing it on and off (engine/llama/flash_choice.py): the verdict's rule, its
measurement on the real default model (on either face), the store's verdict at the next load of
either face, and what it must not override (the user's setting, a quantized V cache, another thread
count, a hostile store entry)."""

from __future__ import annotations

import math
import threading
from dataclasses import replace
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
    {"depth": 512, "prefill_on_s": 1, "prefill_off_s": 1, "decode_on_s": 1, "decode_off_s": 1, "slots": 0},
    {"depth": 512, "prefill_on_s": 1, "prefill_off_s": 1, "decode_on_s": 1, "decode_off_s": 1, "slots": True},
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


FACES = {  # the faces and KV layouts a load can make: the verdict's rule is the same on each
    "Engine": lambda **kw: edgeinfer.load(**kw),
    "BatchEngine, a stream per slot": lambda **kw: edgeinfer.BatchEngine.load(
        batch=edgeinfer.BatchOptions(parallel=2, calibrate_when_idle=False), **kw),
    "BatchEngine, one cache": lambda **kw: edgeinfer.BatchEngine.load(
        batch=edgeinfer.BatchOptions(parallel=2, calibrate_when_idle=False, kv_unified=True), **kw),
}


LAYOUT = {"Engine": 1, "BatchEngine, a stream per slot": 1, "BatchEngine, one cache": 2}  # FlashAttnChoice.slots


@pytest.mark.parametrize("face", FACES)
def test_every_face_takes_the_verdict_measured_for_its_layout(default_model_path: Path, face: str):
    """One rule on both faces: flash attention left unset takes the store's verdict for the face's
    attention layout, one sequence's cells (an Engine; a BatchEngine's stream per slot) or N slots in
    one cache (where flash attention skips the other slots' cells: a verdict of its own), and never
    another layout's; the user's setting always wins."""
    store = Store()
    options = LoadOptions(n_threads=2)
    mine, other = LAYOUT[face], 1 if LAYOUT[face] == 2 else 2
    remember_flash_attn(default_model_path, options, store, replace(_choice(0.02, 0.01), slots=other))
    with FACES[face](n_ctx=512, n_threads=2) as engine:
        assert engine.options.flash_attn is None  # only the other layout's verdict: llama.cpp's choice
    for verdict in (_choice(0.02, 0.01), _choice(0.01, 0.02)):
        remember_flash_attn(default_model_path, options, store, replace(verdict, slots=mine))
        with FACES[face](n_ctx=512, n_threads=2) as engine:
            assert engine.options.flash_attn is verdict.flash_attn
            done = engine.generate("Hello", edgeinfer.GenerateOptions(max_tokens=4)).result()
            assert done.stats.generated_tokens > 0
    with FACES[face](n_ctx=512, n_threads=2, flash_attn=True) as engine:
        assert engine.options.flash_attn is True
    # a verdict stored under a layout's key but measured for another is no verdict
    store.write_cache("flash-attn", verdict_key(default_model_path, options, mine),
                      replace(_choice(0.02, 0.01), slots=other).to_dict())
    assert with_measured_flash_attn(default_model_path, options, store, mine).flash_attn is None


@pytest.mark.slow
@pytest.mark.parametrize("face", FACES)
def test_either_face_measures_the_verdict_of_its_layout_for_the_next_load(default_model_path: Path, face: str):
    """`measure_flash_attn` on both faces, in the face's layout (one cache for every slot: a row of
    each slot a step, over cells of its own); it waits for the running request (a BatchEngine runs
    it between two steps of its scheduler), and the verdict it keeps is the next load's of that
    layout, on either face."""
    with FACES[face](n_ctx=512, n_threads=2) as engine:
        assert engine.options.flash_attn is None
        tokens = engine.tokenize("def add(a, b):\n    return a + b\n" * 20, add_special=True)[:96]
        running = engine.generate("Once upon a time", edgeinfer.GenerateOptions(max_tokens=8))
        worker = threading.Thread(target=running.result)
        worker.start()
        choice = engine.measure_flash_attn(tokens, steps=4)
        worker.join(60)
        assert running.done is not None and running.done.finish_reason in ("length", "eos")
        assert choice.depth == 96 and choice.slots == LAYOUT[face] and min(choice.decode_on_s, choice.decode_off_s) > 0
        with pytest.raises(edgeinfer.InvalidOptionError, match="prompt tokens"):
            engine.measure_flash_attn([], steps=4)
        with pytest.raises(edgeinfer.InvalidOptionError, match="prompt tokens"):
            engine.measure_flash_attn(tokens * 10, steps=4)  # more than the context holds
    for other, layout in LAYOUT.items():
        with FACES[other](n_ctx=512, n_threads=2) as engine:
            assert engine.options.flash_attn is (choice.flash_attn if layout == choice.slots else None)
