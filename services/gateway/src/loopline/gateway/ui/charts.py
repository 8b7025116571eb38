"""Line charts as inline SVG, drawn on the server: a page shows its curves without JavaScript, and
a live page gets the redrawn SVG over its event stream (ui/live_api.py). No chart library to ship
or load: a curve is one ``<polyline>``.

A curve keeps at most ``MAX_POINTS`` points however long the run (``Curve.add`` halves it by
keeping every other point when it doubles), so a page open for hours draws the same few hundred.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

from markupsafe import Markup

MAX_POINTS = 400
WIDTH, HEIGHT = 640, 220
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 56, 12, 12, 28


@dataclass
class Curve:
    name: str
    points: list[tuple[float, float]] = field(default_factory=list)  # (step, value), steps increasing
    stride: int = 1  # every stride-th point offered is kept
    _offered: int = 0

    def add(self, x: float, y: float) -> None:
        if not math.isfinite(y):
            return
        if self.points and x <= self.points[-1][0]:  # a restarted run's steps again: draw the newest
            self.points = [p for p in self.points if p[0] < x]
        self._offered += 1
        if (self._offered - 1) % self.stride:
            return
        self.points.append((x, y))
        if len(self.points) >= 2 * MAX_POINTS:
            self.points = self.points[::2]
            self.stride *= 2

    @property
    def last(self) -> tuple[float, float] | None:
        return self.points[-1] if self.points else None


def _ticks(low: float, high: float, count: int = 4) -> list[float]:
    if high <= low:
        return [low]
    return [low + (high - low) * i / count for i in range(count + 1)]


def _label(value: float) -> str:
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.2e}"


def svg(curve: Curve, *, title: str, x_label: str = "step") -> Markup:
    """``curve`` as an accessible SVG figure (``role="img"`` with its title and last value)."""
    last = curve.last
    summary = f"{title}: {len(curve.points)} points" + (
        f", last {_label(last[1])} at {x_label} {last[0]:g}" if last else ", none yet")
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(summary)}" '
             f'data-points="{len(curve.points)}"><title>{escape(summary)}</title>']
    if not curve.points:
        parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" class="empty">'
                     'no points yet</text></svg>')
        return Markup("".join(parts))
    xs = [p[0] for p in curve.points]
    ys = [p[1] for p in curve.points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 0.5, y1 + 0.5
    if x1 == x0:
        x1 = x0 + 1
    plot_w, plot_h = WIDTH - PAD_LEFT - PAD_RIGHT, HEIGHT - PAD_TOP - PAD_BOTTOM

    def sx(x: float) -> float:
        return PAD_LEFT + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return PAD_TOP + (1 - (y - y0) / (y1 - y0)) * plot_h

    for tick in _ticks(y0, y1):
        y = sy(tick)
        parts.append(f'<line class="grid" x1="{PAD_LEFT}" x2="{WIDTH - PAD_RIGHT}" y1="{y:.1f}" '
                     f'y2="{y:.1f}"/><text class="tick" x="{PAD_LEFT - 6}" y="{y + 4:.1f}" '
                     f'text-anchor="end">{_label(tick)}</text>')
    for tick in sorted({round(t) for t in _ticks(x0, x1)}):  # steps: whole numbers, each once
        parts.append(f'<text class="tick" x="{sx(tick):.1f}" y="{HEIGHT - 8}" text-anchor="middle">'
                     f'{tick:.0f}</text>')
    line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in curve.points)
    parts.append(f'<polyline class="curve" points="{line}"/>')
    if len(curve.points) == 1:
        parts.append(f'<circle class="curve-point" cx="{sx(xs[0]):.1f}" cy="{sy(ys[0]):.1f}" r="3"/>')
    parts.append("</svg>")
    return Markup("".join(parts))
