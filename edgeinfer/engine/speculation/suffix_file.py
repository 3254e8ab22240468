"""The suffix drafter's memory kept on disk (opt-in: LoadOptions.suffix_memory): one file per model
and scope, so a restarted server or a reopened chat drafts from the answers it gave before.

What a file holds: the token ids of one scope's remembered answers (each with the PROMPT_TAIL
prompt tokens before it), oldest first, at most the memory's token budget — ids, never text, and
never the scope itself (an API key's digest is digested again for the file's name and header).
A file is read only into the scope whose digest it carries, for the model whose identity it
carries, with that vocabulary size; anything else — another model, another scope, a damaged,
truncated or hostile file, an id outside the vocabulary, a declared length past the budget — is
ignored with one warning line, and the memory starts empty. Reads are bounded (the budget's bytes
plus a header), never follow a link, never block on a FIFO; writes are atomic (temp file + rename).

Layout (little-endian): the header `<8sIIIIII16s` — magic, version, n_vocab, identity length,
texts, tokens, CRC-32 of the rest, the scope's digest — then the model identity (UTF-8), each
text's length (u32), and the tokens (u32).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...fsutil import atomic_path

__all__ = ["SuffixKeeper", "SAVE_INTERVAL_S", "MAGIC", "VERSION", "HEADER", "scope_digest"]

log = logging.getLogger(__name__)

MAGIC = b"EISUFFIX"
VERSION = 1
HEADER = struct.Struct("<8sIIIIII16s")
_MAX_IDENTITY = 4096  # bytes of a model identity (a path, a size, a time)
# The least time between two saves after finished requests. Measured on the 2-core test machine:
# writing a whole 64k-token scope takes ~3 ms on the scheduler thread (reading one back into a
# corpus ~110 ms, once per scope); the bound keeps a busy server from rewriting every request.
SAVE_INTERVAL_S = 10.0


def scope_digest(scope: str) -> bytes:
    """16 bytes naming a scope on disk (its file name and header): the scope is never written."""
    return hashlib.sha256(b"edgeinfer-suffix-scope\0" + scope.encode("utf-8", "surrogatepass")).digest()[:16]


class SuffixKeeper:
    """Reads and writes one model's scope files in `folder` (see the module). Never raises from
    `load` or `save`: a file it cannot use, or cannot write, is one warning line."""

    def __init__(self, folder: Path, identity: str, n_vocab: int, max_tokens: int, interval: float = SAVE_INTERVAL_S):
        self.folder = Path(folder)
        self.identity = identity.encode("utf-8", "surrogatepass")[:_MAX_IDENTITY]
        self.n_vocab = n_vocab
        self.max_tokens = max_tokens
        self.interval = interval

    def path(self, scope: str) -> Path:
        return self.folder / f"{scope_digest(scope).hex()}.bin"

    def max_bytes(self) -> int:
        return HEADER.size + _MAX_IDENTITY + 8 * self.max_tokens

    # -- reading -----------------------------------------------------------------------------------
    def load(self, scope: str) -> list[list[int]]:
        """The scope's kept texts, oldest first; [] when there is no file or it is not usable."""
        path = self.path(scope)
        try:
            data = self._read(path)
        except FileNotFoundError:
            return []
        except OSError as e:
            log.warning("suffix memory: ignoring %s: cannot read it (%s)", path, e.strerror or e)
            return []
        try:
            return self._decode(data, scope)
        except ValueError as e:
            log.warning("suffix memory: ignoring %s: %s", path, e)
            return []

    def _read(self, path: Path) -> bytes:
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        fd = os.open(path, flags)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(0, "not a regular file")
            limit = self.max_bytes() + 1
            chunks, got = [], 0
            while got < limit and (chunk := os.read(fd, limit - got)):
                chunks.append(chunk)
                got += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _decode(self, data: bytes, scope: str) -> list[list[int]]:
        if len(data) > self.max_bytes():
            raise ValueError(f"larger than a memory of {self.max_tokens} tokens can be")
        if len(data) < HEADER.size:
            raise ValueError("truncated (no whole header)")
        magic, version, n_vocab, id_len, n_texts, n_tokens, crc, digest = HEADER.unpack_from(data)
        if magic != MAGIC:
            raise ValueError("not a suffix memory file (wrong magic)")
        if version != VERSION:
            raise ValueError(f"version {version}, this edgeinfer reads {VERSION}")
        if digest != scope_digest(scope):
            raise ValueError("it belongs to another scope")
        if n_tokens > self.max_tokens or n_texts > n_tokens or id_len > _MAX_IDENTITY:
            raise ValueError(f"it declares {n_texts} texts of {n_tokens} tokens, more than the budget of "
                             f"{self.max_tokens}")
        if len(data) != HEADER.size + id_len + 4 * (n_texts + n_tokens):
            raise ValueError("truncated or padded (its size does not match its header)")
        body = memoryview(data)[HEADER.size:]
        if zlib.crc32(body) != crc:
            raise ValueError("damaged (checksum mismatch)")
        if bytes(body[:id_len]) != self.identity:
            raise ValueError("it was kept for another model file")
        if n_vocab != self.n_vocab:
            raise ValueError(f"its vocabulary has {n_vocab} tokens, this model's {self.n_vocab}")
        lengths = np.frombuffer(body, dtype="<u4", count=n_texts, offset=id_len)
        tokens = np.frombuffer(body, dtype="<u4", count=n_tokens, offset=id_len + 4 * n_texts)
        if n_texts and (int(lengths.min()) < 1 or int(lengths.sum(dtype=np.int64)) != n_tokens):
            raise ValueError("its text lengths do not add up to its tokens")
        if n_tokens and int(tokens.max()) >= self.n_vocab:
            raise ValueError(f"token id {int(tokens.max())} is outside the vocabulary (0..{self.n_vocab - 1})")
        ids = tokens.tolist()
        out, at = [], 0
        for n in lengths.tolist():
            out.append(ids[at : at + n])
            at += n
        return out

    # -- writing -----------------------------------------------------------------------------------
    def encode(self, scope: str, texts: Sequence[Sequence[int]]) -> bytes:
        """The file for `texts` (oldest first): the newest that fit the budget."""
        kept: list[Sequence[int]] = []
        total = 0
        for text in reversed(texts):
            if not text or total + len(text) > self.max_tokens:
                continue
            kept.append(text)
            total += len(text)
        kept.reverse()
        lengths = np.array([len(t) for t in kept], dtype="<u4")
        tokens = np.fromiter((t for text in kept for t in text), dtype="<u4", count=total)
        body = self.identity + lengths.tobytes() + tokens.tobytes()
        return HEADER.pack(MAGIC, VERSION, self.n_vocab, len(self.identity), len(kept), total, zlib.crc32(body),
                           scope_digest(scope)) + body

    def save(self, scope: str, texts: Sequence[Sequence[int]]) -> bool:
        """Write the scope's file atomically; False (and one warning) when it cannot be written."""
        path = self.path(scope)
        try:
            data = self.encode(scope, texts)
            self.folder.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:  # (no fsync: a file cut short by a crash fails its checks)
                with open(tmp, "wb") as f:
                    f.write(data)
        except Exception as e:  # noqa: BLE001 - a memory that cannot be kept never stops a model
            log.warning("suffix memory: could not write %s: %s", path, getattr(e, "strerror", None) or e)
            return False
        return True
