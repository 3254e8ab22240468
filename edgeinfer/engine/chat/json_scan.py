"""An incremental JSON scanner: how much of a growing text is one JSON value (tool-call parsing)."""

from __future__ import annotations

import json
import string

__all__ = ["JsonScan"]


class JsonScan:
    """An incremental JSON scanner: fed a growing text, it finds where the first JSON value ends
    (`done`, `end`), refuses what is not JSON (`error`), and records the spans of the members of a
    top-level object (`members`: key -> (start, end); `key`/`value_start` for the member in
    progress). Each character is looked at once."""

    _WS = " \t\n\r"

    def __init__(self) -> None:
        self.pos = 0
        self.stack: list[str] = []
        self.expect = "value"  # value | key | first-key | colon | next | first-value
        self.scalar = ""  # "str" | "key" | "num" | "lit" while one is being read
        self.scalar_start = -1
        self.esc = False
        self.hex = 0
        self.members: dict[str, tuple[int, int]] = {}
        self.key: str | None = None
        self.value_start = -1
        self.done = False
        self.end = -1
        self.error = ""

    def feed(self, text: str, final: bool = False) -> None:
        while self.pos < len(text) and not self.done and not self.error:
            c = text[self.pos]
            if self.scalar in ("str", "key"):
                self._string_char(text, c)
                continue
            if self.scalar:  # a number or a literal: runs until a character that cannot continue it
                if (c.isalnum() or c in "+-.") and self.pos - self.scalar_start < 64:
                    self.pos += 1
                    continue
                if not self._end_scalar(text, self.pos):
                    return
                continue
            self._structure(text, c)
        if final and self.scalar in ("num", "lit") and not self.error:
            self._end_scalar(text, self.pos)

    def _string_char(self, text: str, c: str) -> None:
        self.pos += 1
        if self.hex:
            if c not in string.hexdigits:
                self.error = "bad \\u escape"
            self.hex -= 1
        elif self.esc:
            self.esc = False
            if c == "u":
                self.hex = 4
            elif c not in '"\\/bfnrt':
                self.error = f"bad escape \\{c}"
        elif c == "\\":
            self.esc = True
        elif c == '"':
            kind, self.scalar = self.scalar, ""
            if kind == "key":
                key = json.loads(text[self.scalar_start : self.pos])
                if len(self.stack) == 1:
                    self.key = key
                self.expect = "colon"
            else:
                self._value_end(self.pos)
        elif ord(c) < 0x20:
            self.error = "a control character in a string"

    def _end_scalar(self, text: str, end: int) -> bool:
        raw = text[self.scalar_start : end]
        self.scalar = ""
        try:
            json.loads(raw)
        except ValueError:
            self.error = f"{raw!r} is not a JSON value"
            return False
        self._value_end(end)
        return True

    def _structure(self, text: str, c: str) -> None:
        if c in self._WS:
            self.pos += 1
            return
        expect = self.expect
        if expect in ("value", "first-value"):
            if expect == "first-value" and c == "]":
                self._close("[")
                return
            if len(self.stack) == 1 and self.stack[0] == "{":
                self.value_start = self.pos
            if c in "{[":
                self.stack.append(c)
                self.expect = "first-key" if c == "{" else "first-value"
                self.pos += 1
            elif c == '"':
                self.scalar, self.scalar_start = "str", self.pos
                self.pos += 1
            elif c in "-0123456789tfn":
                self.scalar, self.scalar_start = ("num" if c not in "tfn" else "lit"), self.pos
                self.pos += 1
            else:
                self.error = f"unexpected {c!r}"
        elif expect in ("key", "first-key"):
            if c == '"':
                self.scalar, self.scalar_start = "key", self.pos
                self.pos += 1
            elif c == "}" and expect == "first-key":
                self._close("{")
            else:
                self.error = f"unexpected {c!r} where a key belongs"
        elif expect == "colon":
            if c == ":":
                self.expect = "value"
                self.pos += 1
            else:
                self.error = f"unexpected {c!r} where ':' belongs"
        else:  # next: "," or the container's end
            top = self.stack[-1]
            if c == ",":
                self.expect = "key" if top == "{" else "value"
                self.pos += 1
            elif (c == "}" and top == "{") or (c == "]" and top == "["):
                self._close(top)
            else:
                self.error = f"unexpected {c!r} where ',' belongs"

    def _close(self, kind: str) -> None:
        self.stack.pop()
        self.pos += 1
        self._value_end(self.pos)

    def _value_end(self, end: int) -> None:
        if not self.stack:
            self.done, self.end = True, end
            return
        self.expect = "next"
        if len(self.stack) == 1 and self.stack[0] == "{" and self.value_start >= 0 and self.key is not None:
            self.members[self.key] = (self.value_start, end)
            self.value_start = -1
