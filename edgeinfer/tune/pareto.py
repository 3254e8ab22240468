"""The result's table: every measured setup as a row (speed, time to first token, KLD, memory), and
the Pareto frontier: the rows no other row beats in all four at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .measure import LEVELS, Measurement
from .space import Setup

__all__ = ["Row", "pareto", "frontier", "table_rows", "TABLE_HEADER"]

T = TypeVar("T")

TABLE_HEADER = ["", "SETUP", "TOK/S", "DECODE", "TTFT S", "KLD", "MEMORY", "LEVEL", "RUNS"]


@dataclass(frozen=True)
class Row:
    """A setup at the highest level it was measured at (the median run of that level)."""

    setup: Setup
    measurement: Measurement
    runs: int
    kld: float | None
    memory: int
    chosen: bool = False
    on_frontier: bool = False
    kld_err: float = 0.0  # the KLD's standard error (0: none known)

    @property
    def level(self) -> int:
        return self.measurement.level

    def to_dict(self) -> dict[str, Any]:
        return {"setup": self.setup.to_dict(), "label": self.setup.label(), "measurement": self.measurement.to_dict(),
                "runs": self.runs, "kld": self.kld, "memory": self.memory, "chosen": self.chosen,
                "on_frontier": self.on_frontier, "kld_err": self.kld_err}

    @classmethod
    def from_dict(cls, data: object) -> Row:
        if not isinstance(data, dict):
            raise ValueError("a row must be an object")
        setup, measurement = Setup.from_dict(data.get("setup")), Measurement.from_dict(data.get("measurement"))
        kld, memory, runs = data.get("kld"), data.get("memory"), data.get("runs", 1)
        if kld is not None and (isinstance(kld, bool) or not isinstance(kld, (int, float))):
            raise ValueError(f"bad kld {kld!r}")
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 0:
            raise ValueError(f"bad memory {memory!r}")
        if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
            raise ValueError(f"bad runs {runs!r}")
        err = data.get("kld_err", 0.0)
        if isinstance(err, bool) or not isinstance(err, (int, float)) or not 0 <= err < 1e6:
            raise ValueError(f"bad kld_err {err!r}")
        return cls(setup, measurement, runs, None if kld is None else float(kld), memory, bool(data.get("chosen")),
                   bool(data.get("on_frontier")), float(err))


def pareto(items: Sequence[T], score: Callable[[T], tuple[float, ...]]) -> list[T]:
    """The items no other item scores at least as high on in every component and higher in one
    (every component is maximized: negate what should be small)."""
    scored = [(score(i), i) for i in items]
    out = []
    for s, item in scored:
        dominated = any(all(o >= x for o, x in zip(other, s)) and any(o > x for o, x in zip(other, s))
                        for other, _ in scored)
        if not dominated:
            out.append(item)
    return out


def _objectives(r: Row) -> tuple[float, ...]:
    return (r.measurement.tok_s, -r.measurement.ttft_s, -(r.kld if r.kld is not None else float("inf")), -float(r.memory))


def frontier(rows: Sequence[Row]) -> list[Row]:
    """The frontier among the rows of the highest level measured (lower levels ran less of the
    workload: their speeds are not comparable), fastest first."""
    if not rows:
        return []
    top = max(r.level for r in rows)
    return sorted(pareto([r for r in rows if r.level == top and r.kld is not None], _objectives),
                  key=lambda r: -r.measurement.tok_s)


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def table_rows(rows: Sequence[Row], *, frontier_only: bool = False) -> list[list[str]]:
    """Text rows under TABLE_HEADER: highest level first, fastest first; `*` marks the choice, `F`
    a frontier row."""
    shown = [r for r in rows if r.on_frontier or r.chosen] if frontier_only else list(rows)
    shown.sort(key=lambda r: (-r.level, -r.measurement.tok_s))
    out = []
    for r in shown:
        m = r.measurement
        mark = "*" if r.chosen else ("F" if r.on_frontier else "")
        out.append([mark, r.setup.label(), f"{m.tok_s:.1f}", f"{m.decode_tok_s:.1f}", f"{m.ttft_s:.2f}",
                    "-" if r.kld is None else f"{r.kld:.4f}", _size(r.memory), f"{m.level}/{len(LEVELS) - 1}",
                    str(r.runs)])
    return out
