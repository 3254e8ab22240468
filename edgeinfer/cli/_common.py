"""Pieces shared by the CLI commands: common flags and a plain-text progress bar (no rich)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

__all__ = ["common_options", "ProgressBar", "format_bytes", "print_table"]


def common_options() -> argparse.ArgumentParser:
    """Flags every command accepts, before or after the command name."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="show edgeinfer's diagnostics on stderr (-vv: also llama.cpp's log lines)")
    return p


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def print_table(rows: list[list[str]], header: list[str], out: TextIO | None = None) -> None:
    """Left-aligned text table; numbers are right-aligned."""
    out = out or sys.stdout
    table = [header] + rows
    widths = [max(len(str(r[i])) for r in table) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        cells = []
        for i, cell in enumerate(row):
            s = str(cell)
            numeric = s.replace(".", "", 1).replace("%", "").replace("×", "").replace("-", "", 1).isdigit()
            cells.append(s.rjust(widths[i]) if numeric and row is not header else s.ljust(widths[i]))
        return "  ".join(cells).rstrip()

    print(fmt(header), file=out)
    for r in rows:
        print(fmt(r), file=out)


class ProgressBar:
    """A one-line progress bar on stderr, redrawn at most 10 times a second.

    Shows count/total, rate and ETA; `unit="B"` formats bytes. Silent when stderr is not a
    terminal except for the final line, so logs stay readable.
    """

    def __init__(self, label: str, total: float | None, unit: str = "", stream: TextIO | None = None):
        self.label = label
        self.total = total
        self.unit = unit
        self.stream = stream or sys.stderr
        self.done = 0.0
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._tty = self.stream.isatty()

    def _fmt(self, n: float) -> str:
        return format_bytes(n) if self.unit == "B" else f"{n:.0f}{self.unit}"

    def update(self, done: float, total: float | None = None, label: str | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        if label is not None:
            self.label = label
        now = time.monotonic()
        if self._tty and now - self._last_draw >= 0.1:
            self._last_draw = now
            self.stream.write("\r\033[K" + self._line(now))
            self.stream.flush()

    def _line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        if self.total:
            frac = min(self.done / self.total, 1.0)
            width = 24
            bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            return (
                f"{self.label} [{bar}] {frac * 100:5.1f}% {self._fmt(self.done)}/{self._fmt(self.total)} "
                f"{self._fmt(rate)}/s ETA {eta:4.0f}s"
            )
        return f"{self.label} {self._fmt(self.done)} {self._fmt(rate)}/s"

    def close(self) -> None:
        now = time.monotonic()
        prefix = "\r\033[K" if self._tty else ""
        self.stream.write(prefix + self._line(now) + f" ({now - self.start:.1f}s)\n")
        self.stream.flush()
