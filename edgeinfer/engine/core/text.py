"""Turning token bytes into streamed text: UTF-8 across token boundaries and stop strings."""

from __future__ import annotations

import codecs

__all__ = ["TextAssembler"]


class TextAssembler:
    """Collects token pieces and releases text that is safe to show.

    Text that could still become the start of a stop string is held back until it cannot; a
    multi-byte character split across tokens is released when complete.
    """

    def __init__(self, stop: tuple[str, ...] = ()):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self.text = ""
        self._emitted = 0

    def push(self, piece: bytes) -> tuple[str, bool]:
        """Add a token's bytes; return (newly releasable text, whether a stop string was hit)."""
        self.text += self._decoder.decode(piece)
        if self._stop:
            hit = self._find_stop()
            if hit is not None:
                self.text = self.text[:hit]
                return self._release(hit), True
            return self._release(len(self.text) - self._held_back()), False
        return self._release(len(self.text)), False

    @property
    def pending(self) -> bool:
        """Whether `flush` would release more: text held back as a possible stop string's start,
        or the bytes of an unfinished character."""
        return self._emitted < len(self.text) or bool(self._decoder.getstate()[0])

    def flush(self) -> str:
        self.text += self._decoder.decode(b"", final=True)
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        out = self.text[self._emitted : upto]
        self._emitted = upto
        return out

    def _find_stop(self) -> int | None:
        best = None
        for s in self._stop:
            # A stop string can only start where it could not have been found before.
            i = self.text.find(s, max(0, self._emitted - len(s) + 1))
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def _held_back(self) -> int:
        """Length of the longest tail that is a proper prefix of some stop string."""
        tail = self.text[self._emitted :]
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(tail)), longest, -1):
                if tail.endswith(s[:k]):
                    longest = k
                    break
        return longest
