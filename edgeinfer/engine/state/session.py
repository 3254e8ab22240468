"""A sequence's KV state saved to a file and restored from it: conversations that resume.

Re-reading a long conversation costs the whole prefill again (a 4k-token chat: about two minutes
for the 1.5B on 2 cores); llama.cpp can write one sequence's keys and values to a file and read
them back. This module does that safely.

The file (one file, written under a temporary name and renamed when complete):

    [llama.cpp's sequence-state file, as `llama_state_seq_save_file` writes it: "ggsq" v3, the
     token ids, then the cells of the sequence and their K/V rows, layer by layer]
    [trailer: UTF-8 JSON, at most MAX_TRAILER bytes][u32 trailer length][8 bytes TRAILER_MAGIC]

The trailer ties the state to what it is only valid for: the model file's sha256, the K/V cache
types, the exact token ids (their sha256) and the state's own size and sha256.

Restoring trusts nothing in the file. Every size is bounded before anything is allocated, the
trailer must name this model (by content hash), these cache types and a token count that fits the
slot, the llama.cpp part must have exactly the size its token count implies for this context's
layout, its sha256 must match, and then every field llama.cpp will read is checked as llama.cpp
would want it (edgeinfer/engine/state/file_format.py): one stream, cells at positions 0..n-1 of one sequence, the
same layers, types and row sizes as this context's own cache (learned once per context from a
state of its own). Only then does llama.cpp see the bytes, and it sees exactly the bytes that were
checked: they are read once into memory and handed over with `llama_state_seq_set_data` (no second
read of a file that could change in between), re-framed for this context's number of KV streams,
so a state saved on one engine face restores on the other. A refused state is one log line and no change to the
cache. The hash catches corruption and truncation, not a forger who recomputes it: a forged file
can only make replies wrong, never crash the process (its structure is checked), and its K/V
values must be finite numbers (file_format.check_finite: a NaN would reach logprobs and replies).

A file is only ever opened as a regular file: O_NOFOLLOW (a symbolic link is refused), O_NONBLOCK
(a FIFO or a device cannot block the open, and so the engine's scheduler), then fstat of what was
opened — never a check of the path before it is opened (it could change in between).
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import errno
import hashlib
import json
import logging
import mmap
import os
import stat
import struct
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ...errors import DiskSpaceError, InvalidOptionError, StoreError
from ...fsutil import atomic_path, ensure_free_space, sha256_file
from .file_format import GGSQ_MAGIC, GGSQ_VERSION, IO_MAGIC, MAX_STREAMS, StateLayout, StateRefused, check_finite, \
    learn_layout, parse_state
from ...llama_backend import backend

if TYPE_CHECKING:
    from ...store import ModelManifest, Store
    from ..llama.runtime import LlamaRuntime

__all__ = [
    "SessionIdentity",
    "SessionInfo",
    "RestoreResult",
    "TRAILER_MAGIC",
    "MAX_TRAILER",
    "model_sha256",
    "save_sequence",
    "restore_sequence",
    "read_trailer",
    "face_identity",
    "conversation_tokens",
]

log = logging.getLogger(__name__)

TRAILER_MAGIC = b"EIKVSTAT"
MAX_TRAILER = 64 << 10
FORMAT = "edgeinfer-kv-state"
VERSION = 1

_TAIL = struct.Struct("<I8s")


# -- what a state belongs to -----------------------------------------------------------------------


@dataclass(frozen=True)
class SessionIdentity:
    """What a saved state is valid for: the model file (by content), the K/V cache types, and the
    room one sequence has (`n_ctx`: positions per slot; `n_seq`: slots of the context)."""

    model_name: str
    model_sha256: str
    model_size: int
    arch: str
    kv_types: tuple[str, str]
    n_ctx: int
    n_seq: int


@dataclass(frozen=True)
class SessionInfo:
    """A saved state: `tokens` positions of the sequence in `bytes` bytes. `written` is False when
    the file already held exactly this state (same model, cache types and tokens) and was kept."""

    path: Path
    tokens: int
    bytes: int
    seconds: float
    written: bool = True


@dataclass(frozen=True)
class RestoreResult:
    """The outcome of a restore: true when the sequence now holds `tokens` positions of the saved
    state; otherwise `reason` says why nothing was loaded (the cache is then unchanged, or empty
    where llama.cpp itself failed halfway)."""

    restored: bool
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    reason: str = ""

    def __bool__(self) -> bool:
        return self.restored


class SequenceLike(Protocol):
    """What this module needs of a sequence (engine/core/sequence.py's KVSequence, which calls it)."""

    runtime: LlamaRuntime
    seq_id: int
    cached: list[int]
    saved_logits: Any

    def clear(self) -> None: ...

    def decode(self, tokens: Sequence[int], logits_from: int | None = None) -> int: ...


# -- the model file's hash ------------------------------------------------------------------------

_hash_lock = threading.Lock()
_hashes: dict[tuple[str, int, int, int], str] = {}
_HASH_CACHE = "file-sha256"


def model_sha256(path: Path, manifest: ModelManifest | None = None, store: Store | None = None) -> str:
    """The sha256 of a model file: its store manifest's (when the size agrees), else remembered by
    (path, size, mtime, inode) in this process and in the store's cache, else computed once."""
    real = os.path.realpath(path)
    st = os.stat(real)
    if manifest is not None and isinstance(manifest.sha256, str) and manifest.size == st.st_size \
            and len(manifest.sha256) == 64:
        return manifest.sha256
    key = (real, st.st_size, st.st_mtime_ns, st.st_ino)
    with _hash_lock:
        known = _hashes.get(key)
    if known is not None:
        return known
    stat_key = [st.st_size, st.st_mtime_ns, st.st_ino]
    if store is not None:
        entry = store.read_cache(_HASH_CACHE, real)
        if isinstance(entry, dict) and entry.get("stat") == stat_key and isinstance(entry.get("sha256"), str):
            with _hash_lock:
                _hashes[key] = entry["sha256"]
            return entry["sha256"]
    sha = sha256_file(Path(real))
    with _hash_lock:
        _hashes[key] = sha
    if store is not None:
        try:
            store.write_cache(_HASH_CACHE, real, {"stat": stat_key, "sha256": sha})
        except OSError as e:  # a read-only store only costs hashing again in another process
            log.debug("model hash not remembered: %s", e)
    return sha


_layouts: weakref.WeakKeyDictionary[Any, StateLayout] = weakref.WeakKeyDictionary()
_layouts_lock = threading.Lock()


def _dump(runtime: LlamaRuntime, seq_id: int) -> ctypes.Array[ctypes.c_uint8]:
    ll = backend()
    size = ll.llama_state_seq_get_size(runtime.ctx, seq_id)
    buf = (ctypes.c_uint8 * size)()
    if ll.llama_state_seq_get_data(runtime.ctx, buf, size, seq_id) != size:
        raise StoreError("llama.cpp could not copy a sequence's KV state")
    return buf


def _known_layout(runtime: LlamaRuntime) -> StateLayout | None:
    with _layouts_lock:
        return _layouts.get(runtime)


def _remember_layout(runtime: LlamaRuntime, layout: StateLayout) -> None:
    with _layouts_lock:
        _layouts[runtime] = layout


def _context_layout(seq: SequenceLike) -> StateLayout:
    """This context's state layout, learned once from a state of its own (a sequence with at least
    one cell: `seq` itself, or one token decoded into it and removed again when it is empty; a
    first save learns it from the file it writes instead)."""
    rt = seq.runtime
    known = _known_layout(rt)
    if known is not None:
        return known
    probe = not seq.cached
    if probe:
        seq.clear()
        seq.decode([rt.bos if 0 <= rt.bos < rt.facts.n_vocab else 0])
    try:
        buf = _dump(rt, seq.seq_id)
        mv = memoryview(buf).cast("B")
        magic, _ = struct.unpack_from("<Ii", mv, 0)
        if magic != IO_MAGIC:
            raise StoreError("llama.cpp's sequence state starts with an unknown magic")
        layout = learn_layout(mv, 8, len(mv), len(seq.cached))
    finally:
        if probe:
            seq.clear()
    _remember_layout(rt, layout)
    return layout


# -- the trailer -------------------------------------------------------------------------------------


def _tokens_sha256(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


def _open_regular(path: str | os.PathLike[str]) -> Any:
    """`path` opened for reading, if it is a regular file (see the module): StateRefused otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StateRefused("a symbolic link, not a regular file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StateRefused("not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_trailer(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The trailer of a state file (its JSON), or None when the file has none that parses."""
    try:
        with _open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            return _trailer(f, size)[0]
    except (OSError, StateRefused):
        return None


def _trailer(f: Any, size: int) -> tuple[dict[str, Any], int]:
    """(trailer, size of the llama.cpp part) of an open state file of `size` bytes."""
    if size < _TAIL.size + 12:
        raise StateRefused(f"the file is {size} bytes: too short to be a saved state")
    f.seek(size - _TAIL.size)
    tail = f.read(_TAIL.size)
    if len(tail) != _TAIL.size:
        raise StateRefused("the file shrank while it was read")
    length, magic = _TAIL.unpack(tail)
    if magic != TRAILER_MAGIC:
        raise StateRefused("not an edgeinfer state file (or truncated: its trailer is missing)")
    if not 2 <= length <= MAX_TRAILER or length > size - _TAIL.size - 12:
        raise StateRefused(f"the trailer claims {length} bytes")
    f.seek(size - _TAIL.size - length)
    raw = f.read(length)
    if len(raw) != length:
        raise StateRefused("the file shrank while it was read")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise StateRefused("the trailer is not valid JSON") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise StateRefused("the trailer is not a version of this format that edgeinfer reads")
    return data, size - _TAIL.size - length


def _field(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise StateRefused(f"the trailer's {key!r} is missing or malformed")
    return value


def _sha_field(data: Mapping[str, Any], key: str) -> str:
    value = _field(data, key, str)
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise StateRefused(f"the trailer's {key!r} is not a sha256")
    return value


def _trailer_bytes(identity: SessionIdentity, tokens: Sequence[int], state_bytes: int, state_sha256: str,
                   layout: StateLayout) -> bytes:
    data = {
        "format": FORMAT,
        "version": VERSION,
        "model": {"name": identity.model_name, "sha256": identity.model_sha256, "size": identity.model_size,
                  "arch": identity.arch},
        "kv_types": list(identity.kv_types),
        "n_ctx": identity.n_ctx,
        "n_seq": identity.n_seq,
        "layout": layout.describe(),
        "n_tokens": len(tokens),
        "tokens_sha256": _tokens_sha256(tokens),
        "state_bytes": state_bytes,
        "state_sha256": state_sha256,
        "saved": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
    }
    raw = json.dumps(data, ensure_ascii=True).encode()
    if len(raw) > MAX_TRAILER:  # a model name cannot be this long, but never write what we refuse to read
        raise InvalidOptionError("the state's trailer would be too long")
    return raw + _TAIL.pack(len(raw), TRAILER_MAGIC)


def _matches(data: Mapping[str, Any], identity: SessionIdentity) -> str | None:
    """Why a trailer does not belong to `identity`'s context (None: it does)."""
    model = data.get("model")
    if not isinstance(model, dict):
        return "the trailer names no model"
    sha = model.get("sha256")
    if sha != identity.model_sha256:
        name = model.get("name") if isinstance(model.get("name"), str) else "?"
        return f"saved with another model ({name[:80]}, sha256 {str(sha)[:12]}…), not {identity.model_name}"
    kv = data.get("kv_types")
    if not (isinstance(kv, list) and [str(x) for x in kv] == list(identity.kv_types)):
        shown = "/".join(map(str, kv))[:40] if isinstance(kv, list) else "?"
        return f"saved with a {shown} KV cache, this one is {'/'.join(identity.kv_types)}"
    return None


# -- saving ---------------------------------------------------------------------------------------


def _unchanged(path: Path, identity: SessionIdentity, tokens: Sequence[int]) -> int | None:
    """The size of the file at `path` when its trailer says it holds exactly this state."""
    try:
        with _open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            data, ggsq = _trailer(f, size)
    except (OSError, StateRefused):
        return None
    if _matches(data, identity) is None and data.get("n_tokens") == len(tokens) \
            and data.get("tokens_sha256") == _tokens_sha256(tokens) and data.get("state_bytes") == ggsq:
        return size
    return None


def save_sequence(seq: SequenceLike, path: str | os.PathLike[str], identity: SessionIdentity, *,
                  max_bytes: int | None = None) -> SessionInfo:
    """Write `seq`'s KV state to `path` (see the module). A file that already holds exactly this
    state is kept as it is. `max_bytes`: DiskSpaceError, before anything is written, when the file
    could take more (a quota). A `path` that is not a regular file (a directory, a FIFO) is an
    InvalidOptionError. The caller holds the context (the engine's lock, or the scheduler thread)."""
    t0 = time.perf_counter()
    path = Path(path)
    try:
        mode: int | None = os.lstat(path).st_mode
    except OSError:  # none there (or its folder is none): the write below says why if it cannot be made
        mode = None
    if mode is not None and not stat.S_ISREG(mode):  # (the rename below would fail on a directory)
        raise InvalidOptionError(f"{path.name} is {'a directory' if stat.S_ISDIR(mode) else 'not a regular file'}: "
                                 "a saved state is written only as a regular file")
    rt = seq.runtime
    if rt.facts.recurrent:
        raise InvalidOptionError(f"{identity.model_name}: a recurrent or hybrid model's state cannot be saved")
    tokens = list(seq.cached)
    if _unchanged(path, identity, tokens) is not None:
        return SessionInfo(path, len(tokens), path.stat().st_size, time.perf_counter() - t0, written=False)
    layout = _known_layout(rt)  # else learned from the file written below
    ll = backend()
    need = ll.llama_state_seq_get_size(rt.ctx, seq.seq_id) + 4 * len(tokens) + MAX_TRAILER
    if max_bytes is not None and need > max_bytes:
        raise DiskSpaceError(f"the KV state {path.name} would take up to {need / 1e6:.1f} MB, more than the "
                             f"{max(0, max_bytes) / 1e6:.1f} MB it may")
    ensure_free_space(path.parent, need, f"the KV state {path.name}")
    ids = (ll.llama_token * max(1, len(tokens)))(*tokens)
    try:
        with atomic_path(path) as tmp:
            written = ll.llama_state_seq_save_file(rt.ctx, os.fsencode(tmp), seq.seq_id, ids, len(tokens))
            if written <= 0 or written != tmp.stat().st_size:
                raise StoreError(f"llama.cpp could not write the KV state to {path}")
            with open(tmp, "r+b") as f:
                with mmap.mmap(f.fileno(), written, access=mmap.ACCESS_READ) as mm:
                    mv = memoryview(mm)
                    try:
                        sha = hashlib.sha256(mv).hexdigest()
                        magic, version, n = struct.unpack_from("<III", mv, 0)
                        if (magic, version, n) != (GGSQ_MAGIC, GGSQ_VERSION, len(tokens)):
                            raise StoreError(f"llama.cpp wrote an unexpected state header to {path}")
                        start = 12 + 4 * n
                        if not n:  # an empty sequence: no layout to learn or check
                            written_layout = parse_state(mv, start, written, 0, ext=False).layout
                        elif layout is None:  # the first save on this context: its layout
                            try:
                                layout = written_layout = learn_layout(mv, start, written, n)
                            except StateRefused as e:  # a memory we cannot check (SWA, hybrid)
                                raise InvalidOptionError(f"{identity.model_name}: {e}") from None
                            _remember_layout(rt, layout)
                        else:
                            parse_state(mv, start, written, n, ext=layout.cell_ext, expected=layout, tokens=tokens)
                            written_layout = layout
                    except StateRefused as e:
                        raise StoreError(f"the KV state llama.cpp wrote does not read back: {e}") from None
                    finally:
                        mv.release()
                f.seek(written)
                f.write(_trailer_bytes(identity, tokens, written, sha, written_layout))
                f.flush()
                os.fsync(f.fileno())
            total = tmp.stat().st_size
    except (DiskSpaceError, StoreError):
        raise
    except IsADirectoryError:  # made a directory meanwhile
        raise InvalidOptionError(f"{path.name} is a directory: a saved state is written only as a regular file") \
            from None
    except OSError as e:
        raise StoreError(f"could not save the KV state to {path}: {e.strerror or e}") from None
    return SessionInfo(path, len(tokens), total, time.perf_counter() - t0)


# -- restoring ------------------------------------------------------------------------------------


def _read_into(f: Any, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise StateRefused("the file ended while it was being read (truncated meanwhile)")
        got += n


def restore_sequence(seq: SequenceLike, path: str | os.PathLike[str], identity: SessionIdentity,
                     conversation: Sequence[int] | None = None) -> RestoreResult:
    """Load the state saved at `path` into `seq` if, and only if, every check passes (see the
    module); `conversation`: tokens the saved ones must be a prefix of. A refusal is logged (one
    line) and returned, never raised, and leaves the sequence as it was. The caller holds the
    context (the engine's lock, or the scheduler thread)."""
    t0 = time.perf_counter()
    path = Path(path)
    try:
        result = _restore(seq, path, identity, conversation, t0)
    except StateRefused as e:
        log.warning("%s: saved KV state not loaded: %s", path.name, e)
        return RestoreResult(False, reason=str(e), seconds=time.perf_counter() - t0)
    except OSError as e:
        reason = f"cannot read it: {e.strerror or e}"
        log.warning("%s: saved KV state not loaded: %s", path.name, reason)
        return RestoreResult(False, reason=reason, seconds=time.perf_counter() - t0)
    return result


def _restore(seq: SequenceLike, path: Path, identity: SessionIdentity, conversation: Sequence[int] | None,
             t0: float) -> RestoreResult:
    rt = seq.runtime
    if rt.facts.recurrent:
        raise StateRefused("this model's memory (recurrent or hybrid) cannot restore a saved state")
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        data, ggsq = _trailer(f, size)
        why = _matches(data, identity)
        if why is not None:
            raise StateRefused(why)
        n = _field(data, "n_tokens", int)
        if not 0 <= n < identity.n_ctx:
            raise StateRefused(f"{n} saved tokens do not fit in a sequence of {identity.n_ctx} positions")
        if _field(data, "state_bytes", int) != ggsq:
            raise StateRefused("the trailer's size of the state is not the file's (truncated or appended to)")
        state_sha = _sha_field(data, "state_sha256")
        tokens_sha = _sha_field(data, "tokens_sha256")

        f.seek(0)
        head = f.read(12)
        if len(head) != 12:
            raise StateRefused("the file ends inside its header")
        magic, version, n_file = struct.unpack("<III", head)
        if magic != GGSQ_MAGIC or version != GGSQ_VERSION:
            raise StateRefused(f"not a llama.cpp sequence state of version {GGSQ_VERSION} (magic {magic:#x}, "
                           f"version {version})")
        if n_file != n:
            raise StateRefused(f"the state lists {n_file} tokens, its trailer {n}")
        raw_tokens = f.read(4 * n)
        if len(raw_tokens) != 4 * n:
            raise StateRefused("the file ends inside its token list")
        ids = np.frombuffer(raw_tokens, dtype="<i4")
        if n and (ids.min() < 0 or ids.max() >= rt.facts.n_vocab):
            raise StateRefused("a saved token id is outside this model's vocabulary")
        tokens = [int(t) for t in ids]
        if _tokens_sha256(tokens) != tokens_sha:
            raise StateRefused("the saved tokens are not the ones its trailer names (tampered)")
        if conversation is not None and list(conversation[:n]) != tokens:
            raise StateRefused("saved for other tokens than this conversation's")

        state_len = ggsq - 12 - 4 * n
        ns_raw = f.read(4)
        if len(ns_raw) != 4:
            raise StateRefused("the file ends before its state")
        (ns_file,) = struct.unpack("<I", ns_raw)
        if not 1 <= ns_file <= MAX_STREAMS:
            raise StateRefused(f"the state has {ns_file} KV streams")
        layout = _context_layout(seq) if n else None
        if layout is not None:
            expected = 4 + 4 * ns_file + layout.payload(n)
        else:
            expected = 4 + 4 * ns_file
        if state_len != expected:
            raise StateRefused(f"the state is {state_len} bytes, {expected} expected for {n} tokens in this context "
                           "(truncated, or another layout)")
        # [io magic][seq id][n_stream][count][payload][count 0 ...]: room for either stream count
        n_stream = layout.n_stream if layout is not None else 1
        cap = 8 + 4 + 4 * max(ns_file, n_stream) + (layout.payload(n) if layout is not None else 0)
        buf = (ctypes.c_uint8 * cap)()
        mv = memoryview(buf).cast("B")
        try:
            mv[8:12] = ns_raw
            _read_into(f, mv[12 : 8 + state_len])
            h = hashlib.sha256(head)
            h.update(raw_tokens)
            h.update(mv[8 : 8 + state_len])
            if h.hexdigest() != state_sha:
                raise StateRefused("its sha256 is not the one saved with it (corrupted or tampered)")
            state = parse_state(mv, 8, 8 + state_len, n, ext=layout.cell_ext if layout else False,
                                 expected=layout, tokens=tokens)
            check_finite(mv, state, n)
            if layout is None:
                seq.clear()
                return RestoreResult(True, 0, size, time.perf_counter() - t0)
            # Re-frame for this context: its stream count, the cells in the first stream (llama.cpp
            # restores them into the destination sequence's own stream whichever stream they came from).
            ctypes.memmove(ctypes.addressof(buf) + 16, ctypes.addressof(buf) + state.payload_at, state.payload_len)
            struct.pack_into("<IiII", mv, 0, IO_MAGIC, seq.seq_id, n_stream, n)
            end = 16 + state.payload_len
            mv[end : end + 4 * (n_stream - 1)] = bytes(4 * (n_stream - 1))
            length = end + 4 * (n_stream - 1)
        finally:
            mv.release()
    seq.saved_logits = None
    seq.cached = []  # llama.cpp removes the sequence's cells first, whatever happens next
    got = backend().llama_state_seq_set_data(rt.ctx, buf, length, seq.seq_id)
    if got != length:
        rt.seq_rm(seq.seq_id, 0)
        raise StateRefused(f"llama.cpp refused the checked state (read {got} of {length} bytes); the cache was emptied")
    seq.cached = tokens
    return RestoreResult(True, n, size, time.perf_counter() - t0)


def conversation_tokens(face: Any, conversation: Sequence[Any] | None) -> list[int] | None:
    """A conversation as token ids: chat messages (as given to `chat`) rendered with the face's
    template, or token ids checked against its vocabulary; None stays None."""
    if conversation is None:
        return None
    if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence):
        raise InvalidOptionError("a conversation must be a list of chat messages or of token ids, "
                                 f"got {type(conversation).__name__}")
    if conversation and all(isinstance(m, Mapping) for m in conversation):
        return face.chat_tokens(conversation)
    return face._token_ids(conversation)


def face_identity(face: Any) -> SessionIdentity:
    """The identity of an engine face's context (Engine, BatchEngine: see edgeinfer/engine/faces/common.py)."""
    path = Path(face.path)
    arch = face.info.metadata.get("general.architecture")
    return SessionIdentity(
        model_name=face.name,
        model_sha256=model_sha256(path, face.manifest, face.store),
        model_size=path.stat().st_size,
        arch=arch if isinstance(arch, str) else "",
        kv_types=tuple(face.options.kv_types),  # type: ignore[arg-type]
        n_ctx=face.n_ctx_per_request,
        n_seq=face._slots_count(),
    )
