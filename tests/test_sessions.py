"""Conversations that resume: a sequence's KV state saved with llama.cpp, the engine closed, a new
one loaded ("the app restarted"), the state restored; and every state that must not be loaded
(other model, other tokens, other KV types, truncated, tampered, forged) refused with a log line.

Outputs are compared on an F16 copy of the default model: its batched and one-token paths round
alike (tests/greedy_compare.py says why Q4_1 cannot be compared across batch shapes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from greedy_compare import assert_same_or_near_tie

import edgeinfer
from edgeinfer.engine.core.sequence import common_prefix
from edgeinfer.engine.state.session import MAX_TRAILER, TRAILER_MAGIC, read_trailer

pytestmark = pytest.mark.slow

GREEDY = edgeinfer.GenerateOptions(max_tokens=24, sampling=edgeinfer.SamplingOptions(temperature=0.0))
LOGGER = "edgeinfer.engine.state.session"


def _notes() -> str:
    """About 900 tokens of text that does not repeat itself."""
    colours = ["red", "blue", "green", "amber", "violet", "grey", "white", "black"]
    towns = ["Lyon", "Porto", "Graz", "Turku", "Split", "Ghent", "Bergen", "Cork", "Brno", "Pisa"]
    lines = [f"Item {i}: the {colours[i % 8]} crate from {towns[i % 10]} weighs {17 * i % 97 + 3} kg and "
             f"leaves on day {i * 7 % 31 + 1}." for i in range(1, 41)]
    return "Shipping notes for this week.\n" + "\n".join(lines)


HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": _notes() + "\n\nWhich town does item 3 come from?"},
]
NEXT = {"role": "user", "content": "And how heavy is item 5?"}


def _chat(engine, messages) -> edgeinfer.DoneEvent:
    return engine.chat(messages, GREEDY).result()


@pytest.fixture(scope="module")
def f16(default_model_copy) -> Path:
    return default_model_copy("F16")


@pytest.fixture(scope="module")
def saved(f16, tmp_path_factory) -> dict:
    """A ~1k-token chat on the F16 model, saved; the engine's own continuation and its prefill."""
    root = tmp_path_factory.mktemp("sessions")
    path = root / "chat.kv"
    with edgeinfer.load(f16, n_ctx=2048) as engine:
        first = _chat(engine, HISTORY)
        conversation = HISTORY + [{"role": "assistant", "content": first.text}]
        info = engine.save_session(path, conversation)
        again = engine.save_session(path, conversation)  # the same state: the file is kept
        # what this engine answers next without restarting (its cache is what was saved)
        follow = engine.chat(conversation + [NEXT], GREEDY)
        cont = follow.result()
        tokens = engine.chat_tokens(conversation)
        prompt = engine.chat_tokens(conversation + [NEXT])
    return {"path": path, "info": info, "again": again, "conversation": conversation, "continued": cont,
            "conversation_tokens": tokens, "next_prompt": prompt, "first": first, "f16": f16}


def _copy(saved: dict, tmp_path: Path, name: str = "copy.kv") -> Path:
    target = tmp_path / name
    shutil.copyfile(saved["path"], target)
    return target


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


# -- the state resumes ------------------------------------------------------------------------------


def test_save_writes_one_file_with_a_trailer_and_keeps_an_unchanged_one(saved):
    info, again = saved["info"], saved["again"]
    assert info.written and info.tokens > 900 and info.bytes == saved["path"].stat().st_size
    assert not again.written and again.bytes == info.bytes
    assert list(saved["path"].parent.iterdir()) == [saved["path"]]  # no temporary file left behind
    trailer = read_trailer(saved["path"])
    assert trailer is not None and trailer["n_tokens"] == info.tokens and trailer["kv_types"] == ["f16", "f16"]
    assert trailer["model"]["sha256"] == hashlib.sha256(saved["f16"].read_bytes()).hexdigest()
    # the state is the conversation's prefix (without the generation prompt the template appends)
    assert 900 < info.tokens < len(saved["conversation_tokens"])


def test_a_restarted_engine_reads_only_the_new_message_and_answers_the_same(saved, f16, caplog):
    """The app restarted: a new engine restores the state; the next reply's prefill covers only
    the new message, and it is token for token the reply the first engine gave without a restart,
    and a fresh engine's on the whole history (or parts from it only at a near-tie)."""
    conversation, prompt = saved["conversation"], saved["next_prompt"]
    with edgeinfer.load(f16, n_ctx=2048) as engine:
        result = engine.restore_session(saved["path"], conversation + [NEXT])
        assert result and result.tokens == saved["info"].tokens and not _refusals(caplog)
        done = _chat(engine, conversation + [NEXT])
    stats = done.stats
    assert stats.prompt_tokens == len(prompt)
    # everything saved is reused: the cache held the prompt and the reply's tokens (the template's
    # end-of-turn markers after the reply were never decoded, so they are read with the new message)
    assert stats.cached_tokens == result.tokens <= common_prefix(prompt, saved["conversation_tokens"])
    new_part = len(prompt) - stats.cached_tokens
    assert new_part < 40, f"{new_part} prompt tokens read again"  # the new message and its role markers
    assert done.tokens == saved["continued"].tokens  # the very same cache: the very same reply
    assert saved["continued"].stats.cached_tokens == stats.cached_tokens
    with edgeinfer.load(f16, n_ctx=2048) as fresh:
        reference = _chat(fresh, conversation + [NEXT])
        assert reference.stats.cached_tokens == 0
        assert_same_or_near_tie(fresh, prompt, reference.tokens, done.tokens)


def test_a_batch_engine_slot_restores_a_state_saved_by_engine(saved, f16):
    """The other face: a BatchEngine (one KV stream per slot) restores the single-stream state into
    slot 1; the chat lands there and reads only its new message; a busy slot is refused; erase."""
    conversation = saved["conversation"]
    batch = edgeinfer.BatchOptions(parallel=2, cost_curve={1: 0.01, 2: 0.015}, calibrate_when_idle=False)
    with edgeinfer.BatchEngine.load(f16, batch=batch, n_ctx=4096) as engine:
        assert engine.restore_slot(1, saved["path"], conversation)
        done = engine.chat(conversation + [NEXT], GREEDY).result()
        assert done.stats.cached_tokens == saved["info"].tokens
        assert engine.metrics().slots[1].cached_tokens >= saved["info"].tokens
        assert done.tokens == saved["continued"].tokens
        # a slot that runs a request is busy: 409 for the server
        gen = engine.chat(conversation + [NEXT], edgeinfer.GenerateOptions(max_tokens=400))
        next(iter(gen))
        busy = next(s.index for s in engine.metrics().slots if s.busy)
        with pytest.raises(edgeinfer.EngineBusyError):
            engine.save_slot(busy, saved["path"].parent / "busy.kv")
        gen.cancel()
        gen.result()
        n = engine.metrics().slots[busy].cached_tokens
        assert engine.erase_slot(busy) == n and engine.metrics().slots[busy].cached_tokens == 0
        with pytest.raises(edgeinfer.InvalidOptionError):
            engine.erase_slot(2)


def test_saving_while_another_thread_generates_waits_for_it(saved, f16, tmp_path):
    with edgeinfer.load(f16, n_ctx=2048) as engine:
        gen = engine.chat(HISTORY, edgeinfer.GenerateOptions(max_tokens=40))
        out: dict = {}
        worker = threading.Thread(target=lambda: out.setdefault("done", gen.result()))
        worker.start()
        info = engine.save_session(tmp_path / "during.kv")
        worker.join()
        assert info.tokens > 0 and out["done"].finish_reason in ("length", "stop", "eos")


# -- states that must not be loaded -----------------------------------------------------------------


def _reseal(path: Path, ggsq: Callable[[bytearray], None] | None = None,
            trailer: Callable[[dict], None] | None = None, rehash: bool = True) -> None:
    """A forger's rewrite: change the llama.cpp part and/or the trailer, then recompute its hashes."""
    data = path.read_bytes()
    length, magic = struct.unpack("<I8s", data[-12:])
    assert magic == TRAILER_MAGIC
    body = bytearray(data[: len(data) - 12 - length])
    meta = json.loads(data[len(data) - 12 - length : -12])
    if ggsq is not None:
        ggsq(body)
    if trailer is not None:
        trailer(meta)
    if rehash:
        meta["state_bytes"] = len(body)
        meta["state_sha256"] = hashlib.sha256(body).hexdigest()
    raw = json.dumps(meta).encode()
    path.write_bytes(bytes(body) + raw + struct.pack("<I8s", len(raw), TRAILER_MAGIC))


def _first_cell_offset(body: bytes) -> int:
    n = struct.unpack_from("<I", body, 8)[0]
    return 12 + 4 * n + 8  # header, tokens, n_stream, the stream's cell count


@pytest.fixture(scope="module")
def engine(f16):
    with edgeinfer.load(f16, n_ctx=2048) as e:
        yield e


def _refused(engine, path, caplog, why: str, conversation=None) -> None:
    """Refused with one warning naming `why`; the engine's cache is untouched; the chat still works."""
    before = engine.chat_tokens([{"role": "user", "content": "Hi there"}])
    with engine._slot.hold():  # white box: what the cache holds before
        cached = list(engine._scheduler.slots[0].seq.cached)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = engine.restore_session(path, conversation)
    assert not result and why in result.reason, result.reason
    lines = _refusals(caplog)
    assert len(lines) == 1 and why in lines[0] and path.name in lines[0]
    with engine._slot.hold():
        assert engine._scheduler.slots[0].seq.cached == cached
    done = engine.generate(before, edgeinfer.GenerateOptions(max_tokens=4)).result()
    assert done.stats.generated_tokens >= 1


def test_a_tampered_byte_is_refused(saved, engine, tmp_path, caplog):
    path = _copy(saved, tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # a K/V value
    path.write_bytes(data)
    _refused(engine, path, caplog, "sha256")


def test_a_truncated_state_is_refused(saved, engine, tmp_path, caplog):
    path = _copy(saved, tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    _refused(engine, path, caplog, "trailer")
    path.write_bytes(data[:-1])
    _refused(engine, path, caplog, "trailer")
    path.write_bytes(b"")
    _refused(engine, path, caplog, "too short")
    # cut inside the llama.cpp part, the trailer kept (and resealed: the size check, not the hash)
    path.write_bytes(data)
    _reseal(path, ggsq=lambda body: body.__delitem__(slice(len(body) - 4096, None)))
    _refused(engine, path, caplog, "expected")


def test_another_model_s_state_is_refused(saved, default_model_path, tmp_path, caplog):
    path = _copy(saved, tmp_path)
    with edgeinfer.load(default_model_path, n_ctx=2048) as other:  # the Q4_1 file: same architecture and shapes
        _refused(other, path, caplog, "another model")


def test_other_tokens_are_refused(saved, engine, tmp_path, caplog):
    path = _copy(saved, tmp_path)
    other = [HISTORY[0], {"role": "user", "content": "A different conversation altogether."}]
    _refused(engine, path, caplog, "other tokens", conversation=other)
    # the token list of the llama.cpp part differs from the trailer's (a forger who kept its hash)
    _reseal(path, ggsq=lambda body: struct.pack_into("<i", body, 12 + 4 * 5, 42))
    _refused(engine, path, caplog, "tampered")


def test_another_kv_type_is_refused_also_when_the_trailer_lies(saved, f16, tmp_path, caplog):
    path = _copy(saved, tmp_path)
    with edgeinfer.load(f16, n_ctx=2048, kv_type_k="q8_0") as q8:
        _refused(q8, path, caplog, "KV cache")
        _reseal(path, trailer=lambda meta: meta.__setitem__("kv_types", ["q8_0", "f16"]))
        _refused(q8, path, caplog, "expected")  # the layout: q8_0 rows are not f16 rows
    # a layer's K type rewritten to bf16 (rows of the same size): the per-layer check refuses it
    path = _copy(saved, tmp_path, "bf16.kv")

    def bf16_layer(body: bytearray) -> None:
        n = struct.unpack_from("<I", body, 8)[0]
        at = _first_cell_offset(body) + 12 * n + 8  # past the cells, v_trans and n_layer
        assert struct.unpack_from("<i", body, at)[0] == 1  # GGML_TYPE_F16
        struct.pack_into("<i", body, at, 30)  # GGML_TYPE_BF16

    _reseal(path, ggsq=bf16_layer)
    with edgeinfer.load(f16, n_ctx=2048) as same:
        _refused(same, path, caplog, "K cache type 30")
    with edgeinfer.load(f16, n_ctx=2048, flash_attn=not _flash(saved)) as other_fa:
        _refused(other_fa, _copy(saved, tmp_path, "fa.kv"), caplog, "layers")


def _flash(saved) -> bool:
    """Whether the saved state's V cache is not transposed (flash attention was on)."""
    return not read_trailer(saved["path"])["layout"]["v_transposed"]


def test_forged_cells_are_refused_before_llama_cpp_sees_them(saved, engine, tmp_path, caplog):
    path = _copy(saved, tmp_path)
    _reseal(path, ggsq=lambda body: struct.pack_into("<i", body, _first_cell_offset(body) + 12 * 7, 5000))
    _refused(engine, path, caplog, "positions")
    path = _copy(saved, tmp_path)
    _reseal(path, ggsq=lambda body: struct.pack_into("<I", body, _first_cell_offset(body) + 4, 2))
    _refused(engine, path, caplog, "more than one sequence")
    path = _copy(saved, tmp_path)  # a cell count that is not the token count
    _reseal(path, ggsq=lambda body: struct.pack_into("<I", body, _first_cell_offset(body) - 4, 7))
    _refused(engine, path, caplog, "cells")
    path = _copy(saved, tmp_path)  # a stream count llama.cpp would refuse
    _reseal(path, ggsq=lambda body: struct.pack_into("<I", body, _first_cell_offset(body) - 8, 1 << 30))
    _refused(engine, path, caplog, "streams")


def test_hostile_trailers_and_files_are_refused_without_reading_them(saved, engine, tmp_path, caplog):
    path = _copy(saved, tmp_path)
    _reseal(path, trailer=lambda meta: meta.__setitem__("n_tokens", 10**12))
    _refused(engine, path, caplog, "do not fit")
    path = _copy(saved, tmp_path)
    _reseal(path, trailer=lambda meta: meta.__setitem__("state_sha256", "x" * 64), rehash=False)
    _refused(engine, path, caplog, "not a sha256")
    path = _copy(saved, tmp_path)
    _reseal(path, trailer=lambda meta: meta.__setitem__("version", 99))
    _refused(engine, path, caplog, "version")
    data = path.read_bytes()
    path.write_bytes(data[:-12] + struct.pack("<I8s", MAX_TRAILER + 1, TRAILER_MAGIC))
    _refused(engine, path, caplog, "claims")
    path.write_bytes(b"\0" * 4096 + b"{}" + struct.pack("<I8s", 2, TRAILER_MAGIC))
    _refused(engine, path, caplog, "format")
    path.write_bytes(np.random.default_rng(0).bytes(100_000))
    _refused(engine, path, caplog, "not an edgeinfer state file")
    directory = tmp_path / "a-directory.kv"
    directory.mkdir()
    _refused(engine, directory, caplog, "not a regular file")
    _refused(engine, tmp_path / "missing.kv", caplog, "cannot read")


def test_saving_to_an_unwritable_place_is_one_error_and_nothing_left(engine, tmp_path):
    engine.generate("Hello there, how are you?", edgeinfer.GenerateOptions(max_tokens=2)).result()
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    with pytest.raises(edgeinfer.StoreError, match="could not save"):
        engine.save_session(blocker / "chat.kv")
    assert blocker.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["not-a-directory"]
    with pytest.raises(edgeinfer.InvalidOptionError):
        engine.save_session(tmp_path / "x.kv", "not a conversation")  # type: ignore[arg-type]


def _metadata_offsets(body: bytes) -> list[int]:
    """Every byte llama.cpp reads as structure (not K/V values) in a state's llama.cpp part."""
    n = struct.unpack_from("<I", body, 8)[0]
    cells = _first_cell_offset(body)
    out = list(range(0, 12)) + list(range(cells - 8, cells)) + list(range(cells, cells + 12 * n))
    at = cells + 12 * n
    out += list(range(at, at + 8))  # v_trans, n_layer
    v_trans, n_layer = struct.unpack_from("<II", body, at)
    at += 8
    for _ in range(n_layer):  # K: type, row size, rows
        row = struct.unpack_from("<Q", body, at + 4)[0]
        out += list(range(at, at + 12))
        at += 12 + n * row
    for _ in range(n_layer):  # V, the same shape either way (transposed: type, element size, rows)
        out += list(range(at, at + 12))
        if v_trans:
            el, rows = struct.unpack_from("<II", body, at + 4)
            at += 12 + n * el * rows
        else:
            at += 12 + n * struct.unpack_from("<Q", body, at + 4)[0]
    assert at == len(body)
    return out


def test_forged_structure_never_reaches_llama_cpp_unchecked(engine, tmp_path, caplog):
    """A forger's file (hashes recomputed) with any structural byte changed is refused, unless the
    byte is a cell's sequence id (llama.cpp discards it: any non-negative id restores); the process
    never aborts (llama.cpp's GGML_ASSERTs would kill pytest here)."""
    engine.generate("Tell me about the sea. " * 6, edgeinfer.GenerateOptions(max_tokens=8)).result()
    original = tmp_path / "short.kv"
    engine.save_session(original)
    data = original.read_bytes()
    length = struct.unpack("<I", data[-12:-8])[0]
    body = data[: len(data) - 12 - length]
    n, cells = struct.unpack_from("<I", body, 8)[0], _first_cell_offset(body)
    seq_ids = {cells + 12 * i + k for i in range(n) for k in range(8, 12)}
    rng = np.random.default_rng(25)
    offsets = _metadata_offsets(body)
    restored = []
    for i in range(80):
        path = tmp_path / "fuzz.kv"
        shutil.copyfile(original, path)
        at = int(rng.choice(offsets))
        value = int(rng.integers(0, 256))

        def poke(b: bytearray, at=at, value=value) -> None:
            b[at] = value if b[at] != value else (value + 1) % 256

        _reseal(path, ggsq=poke)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            if engine.restore_session(path):
                restored.append(at)
    assert set(restored) <= seq_ids and len(restored) < 40, restored
    done = engine.generate("Hello there", edgeinfer.GenerateOptions(max_tokens=4)).result()
    assert done.stats.generated_tokens >= 1
