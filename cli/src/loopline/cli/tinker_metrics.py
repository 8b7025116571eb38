"""``loopline tinker metrics``: a tinker-cookbook run's ``metrics.jsonl`` sent to the gateway, so the
dashboard (``/ui/runs/<run>``) draws its reward and other curves beside the loss. The cookbook
writes the file and never posts it; this posts each step once (``--follow``: as the file grows).
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from loopline.cli import plot as plotting
from loopline.cli.client import Gateway

# The gateway takes this many metrics in one post (tinker/run_metrics.py MAX_METRICS).
PER_POST = 64
FOLLOW_EVERY_S = 2.0


def by_step(metrics: Path, keys: list[str]) -> dict[int, dict[str, float]]:
    """step -> {key: value} for the file's rows (plot.load_metrics reads it, as `tinker plot`)."""
    series, _, _ = plotting.load_metrics(metrics, keys)
    steps: dict[int, dict[str, float]] = {}
    for key, points in series.items():
        for x, value in points:
            steps.setdefault(int(x), {})[key] = value
    return steps


def post_metrics(gateway: Gateway, console: Console, run_id: str, metrics: Path, keys: list[str],
                 follow: bool) -> int:
    """Post every step not posted yet; with ``follow``, again every few seconds until Ctrl-C.
    Returns how many steps were posted."""
    posted: set[int] = set()
    # Invariant: every step in ``posted`` has had all of its metrics sent once.
    while True:
        for step, values in sorted(by_step(metrics, keys).items()):
            if step in posted:
                continue
            names = sorted(values)
            for start in range(0, len(names), PER_POST):
                gateway.post_run_metrics(run_id, step, {k: values[k] for k in names[start: start + PER_POST]})
            posted.add(step)
            console.print(f"step {step}: " + ", ".join(f"{k} {values[k]:.4g}" for k in names))
        if not follow:
            return len(posted)
        time.sleep(FOLLOW_EVERY_S)
