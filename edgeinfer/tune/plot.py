"""The trade-off as a picture: speed (tok/s on the workload) against KLD, memory as the marker's size.

`svg` writes an SVG document by hand (no plotting library: the library stays small, and matplotlib
is not a dependency); `text_plot` draws the same in characters for terminals (the TUI's model screen
cannot show images): a grid of rows of tok/s and columns of KLD where each setup is a character
by its memory (`.` up to a third of the largest setup's, `o` up to two thirds, `O` above), `#` a
frontier setup of the largest third, `*` the choice, and `|` the quality bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from xml.sax.saxutils import escape

from .pareto import Row

__all__ = ["svg", "text_plot"]

_W, _H = 760, 460
_LEFT, _RIGHT, _TOP, _BOTTOM = 72, 24, 48, 64


def _nice_ticks(hi: float, n: int = 5) -> list[float]:
    """About n round tick values from 0 to at least hi."""
    if hi <= 0:
        return [0.0, 1.0]
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(math.ceil(hi / step)) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.3g}" if v else "0"


def _points(rows: Sequence[Row]) -> list[Row]:
    top = max((r.level for r in rows), default=0)
    return [r for r in rows if r.level == top and r.kld is not None]


def svg(rows: Sequence[Row], *, title: str, max_kld: float | None = None) -> str:
    """An SVG document of the rows at the highest level measured (see the module)."""
    pts = _points(rows)
    xs = _nice_ticks(max([r.kld or 0.0 for r in pts] + [max_kld or 0.0]) * 1.05 or 0.01)
    ys = _nice_ticks(max((r.measurement.tok_s for r in pts), default=1.0) * 1.05)
    x_hi, y_hi = xs[-1], ys[-1]
    pw, ph = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
    mem_hi = max((r.memory for r in pts), default=1) or 1

    def x(v: float) -> float:
        return _LEFT + v / x_hi * pw

    def y(v: float) -> float:
        return _TOP + ph - v / y_hi * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{_W}" height="{_H}" fill="white"/>',
           f'<text x="{_W / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
           f'<text x="{_W / 2}" y="38" text-anchor="middle" fill="#555">marker area: memory (largest '
           f'{mem_hi / 2**30:.2f} GiB); filled: on the frontier; red: the choice</text>']
    for t in xs:
        out.append(f'<line x1="{x(t):.1f}" y1="{_TOP}" x2="{x(t):.1f}" y2="{_TOP + ph}" stroke="#eee"/>')
        out.append(f'<text x="{x(t):.1f}" y="{_TOP + ph + 16}" text-anchor="middle">{_fmt(t)}</text>')
    for t in ys:
        out.append(f'<line x1="{_LEFT}" y1="{y(t):.1f}" x2="{_LEFT + pw}" y2="{y(t):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{_LEFT - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    out.append(f'<rect x="{_LEFT}" y="{_TOP}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{_LEFT + pw / 2}" y="{_H - 18}" text-anchor="middle">KLD against the reference '
               '(lower is better)</text>')
    out.append(f'<text transform="translate(18,{_TOP + ph / 2}) rotate(-90)" text-anchor="middle">tok/s on the '
               'workload (higher is better)</text>')
    if max_kld is not None and max_kld <= x_hi:
        out.append(f'<line x1="{x(max_kld):.1f}" y1="{_TOP}" x2="{x(max_kld):.1f}" y2="{_TOP + ph}" '
                   'stroke="#c33" stroke-dasharray="5,4"/>')
        out.append(f'<text x="{x(max_kld) + 4:.1f}" y="{_TOP + 14}" fill="#c33">max KLD {_fmt(max_kld)}</text>')
    for r in sorted(pts, key=lambda r: -r.memory):  # the small markers on top
        radius = 3 + 13 * math.sqrt(r.memory / mem_hi)
        fill = "#d62728" if r.chosen else ("#1f77b4" if r.on_frontier else "#bbb")
        opacity = "0.9" if r.on_frontier or r.chosen else "0.5"
        cx, cy = x(r.kld or 0.0), y(r.measurement.tok_s)
        out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{radius:.1f}" fill="{fill}" fill-opacity="{opacity}" '
                   f'stroke="#333" stroke-width="0.6"><title>{escape(r.setup.label())}: '
                   f'{r.measurement.tok_s:.1f} tok/s, KLD {r.kld:.4f}, {r.memory / 2**20:.0f} MiB</title></circle>')
        if r.on_frontier or r.chosen:
            out.append(f'<text x="{cx + radius + 3:.1f}" y="{cy - 3:.1f}" font-size="10">'
                       f'{escape(r.setup.label())}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def text_plot(rows: Sequence[Row], *, max_kld: float | None = None, width: int = 56, height: int = 12) -> str:
    """The same picture in characters (see the module), with its axes' ranges and a legend."""
    pts = _points(rows)
    if not pts:
        return "nothing measured yet"
    x_hi = max([r.kld or 0.0 for r in pts] + [max_kld or 0.0]) * 1.05 or 0.01
    y_hi = max(r.measurement.tok_s for r in pts) * 1.05 or 1.0
    mem_hi = max(r.memory for r in pts) or 1
    grid = [[" "] * width for _ in range(height)]
    if max_kld is not None and max_kld <= x_hi:
        col = min(width - 1, int(max_kld / x_hi * (width - 1)))
        for row in grid:
            row[col] = "|"
    for r in sorted(pts, key=lambda r: (r.chosen, r.on_frontier)):  # the choice drawn last, on top
        col = min(width - 1, int((r.kld or 0.0) / x_hi * (width - 1)))
        line = min(height - 1, int((1 - r.measurement.tok_s / y_hi) * (height - 1) + 0.5))
        mark = "." if r.memory <= mem_hi / 3 else ("o" if r.memory <= 2 * mem_hi / 3 else "O")
        if r.on_frontier and mark == "O":
            mark = "#"
        grid[line][col] = "*" if r.chosen else mark
    label_w = len(f"{y_hi:.1f}")
    out = []
    for i, row in enumerate(grid):
        label = f"{y_hi * (1 - i / (height - 1)):.1f}" if i in (0, height // 2, height - 1) else ""
        out.append(f"{label:>{label_w}} |{''.join(row)}")
    out.append(" " * label_w + " +" + "-" * width)
    out.append(" " * label_w + f"  0{' ' * (width - 12)}KLD {x_hi:.3g}")
    out.append("tok/s up, KLD across; * the choice; . o O memory (thirds of the largest), # a large frontier "
               "setup; | max KLD")
    return "\n".join(out)
