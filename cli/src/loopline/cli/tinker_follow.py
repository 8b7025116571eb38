"""``loopline tinker follow``: the Tinker session workers' events, one line each, as they happen.

A run or a worker is followed to its end (released: exit 0, failed: exit 1); every worker's
events are followed until Ctrl-C. A cut connection is resumed after the last event shown
(the route's ``after``): nothing is missed or shown twice.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.markup import escape

from loopline.cli.client import EXIT_FAILED, EXIT_UNREACHABLE, CliError, Gateway
from loopline.cli.follow import MAX_RECONNECTS

END_KINDS = ("released", "failed")


def describe(event: dict[str, Any]) -> str:
    """One line for a SessionEvent (loopline.common.contracts.tinker_schemas), rich markup escaped."""
    kind, run = event.get("kind", "?"), event.get("model_id")
    when = datetime.fromtimestamp(event["time"]).strftime("%H:%M:%S") if event.get("time") else "--:--:--"
    who = f"run {run}" if run else f"worker {event.get('worker_id', '?')}"
    parts = [f"step {event['step']}" if event.get("step") is not None else "",
             f"loss {event['loss']:.4f}" if isinstance(event.get("loss"), (int, float)) else "",
             _staleness(event), _metrics(event), str(event.get("path") or ""),
             str(event.get("base_model") or "") if kind == "created" else "",
             str(event.get("detail") or "")]
    colour = {"failed": "red", "released": "yellow", "saved": "green", "created": "cyan"}.get(kind)
    label = f"[{colour}]{kind:<8}[/]" if colour else f"{kind:<8}"
    return f"{when} {label} {escape(who)}  " + escape("  ".join(p for p in parts if p))


def _metrics(event: dict[str, Any]) -> str:
    """A "metrics" event's figures, as its client reported them."""
    figures = event.get("metrics") or {}
    if not isinstance(figures, dict):
        return ""
    return ", ".join(f"{k} {v:.4g}" for k, v in sorted(figures.items()) if isinstance(v, (int, float)))


def _staleness(event: dict[str, Any]) -> str:
    """A step's trained samples by steps behind ("samples 0 behind: 24, 1 behind: 8")."""
    behind = event.get("staleness") or {}
    if not isinstance(behind, dict):
        return ""
    counts = sorted((int(k), v) for k, v in behind.items() if str(k).isdigit())
    parts = [f"{k} behind: {v}" for k, v in counts]
    if event.get("unstamped"):
        parts.append(f"other weights: {event['unstamped']}")
    return f"samples {', '.join(parts)}" if parts else ""


def follow_sessions(gateway: Gateway, console: Console, run_id: str | None = None,
                    worker_id: str | None = None, history: bool = False) -> int:
    """Print events until the run or worker ends (its exit code) or, following every worker,
    until interrupted; raises CliError when the gateway stays out of reach."""
    one = run_id is not None or worker_id is not None
    after: int | None = None
    failures = 0
    # Invariant: every event up to id ``after`` has been printed once; failures counts the
    # consecutive attempts that printed nothing (refused, or closed before any event).
    while True:
        shown, cut = 0, False
        try:
            for message in gateway.tinker_events(run_id, worker_id, history=history, after=after):
                try:
                    event = json.loads(message.data)
                except ValueError:
                    continue  # not an event (a proxy's heartbeat): nothing to show
                if not isinstance(event, dict):
                    continue
                event.setdefault("kind", message.event)
                if message.id.isdigit():
                    after = int(message.id)
                shown += 1
                console.print(describe(event), highlight=False, soft_wrap=True)
                if one and event["kind"] in END_KINDS and (event.get("model_id") in (None, run_id)):
                    return EXIT_FAILED if event["kind"] == "failed" else 0
        except CliError as exc:
            if exc.exit_code != EXIT_UNREACHABLE or failures >= MAX_RECONNECTS:
                raise
            cut = True
        if one and not cut and shown == 0:
            # The stream closed by itself with nothing new: the run or worker was over already.
            console.print("(its events end here: it is over)", highlight=False)
            return 0
        failures = 0 if shown else failures + 1
        if failures > MAX_RECONNECTS:
            raise CliError("the session event stream keeps closing", "check the gateway's log", EXIT_FAILED)
        time.sleep(min(0.5 * 2 ** failures, 8.0))
