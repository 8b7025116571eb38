"""``loopline follow``: a job's event stream shown as a progress bar until the job ends."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from loopline.cli.client import EXIT_FAILED, EXIT_UNREACHABLE, CliError, Gateway

TERMINAL_KINDS = ("completed", "failed", "cancelled")
# A replica's answer to a checkpoint, on the job's stream after the job's own events (the gateway
# keeps a completed job's stream open until its newest checkpoint has one, or for a while).
LOADED, REJECTED = "adapter.loaded", "adapter.rejected"
FINISHED_STATUSES = ("COMPLETED", "FAILED", "CANCELLED")
MAX_RECONNECTS = 5


def short(job_hash: str) -> str:
    return job_hash[:12]


def stats_text(event: dict[str, Any]) -> str:
    parts = []
    if event.get("loss") is not None:
        parts.append(f"loss {event['loss']:.4f}")
    if event.get("learning_rate") is not None:
        parts.append(f"lr {event['learning_rate']:.2e}")
    if event.get("tokens_per_s") is not None:
        parts.append(f"{event['tokens_per_s']:,.0f} tok/s")
    return "  ".join(parts)


class _Display:
    """The bar and the lines printed above it; one place that turns events into output."""

    def __init__(self, progress: Progress, task: TaskID, max_steps: int | None):
        self.progress, self.task = progress, task
        # Final events need not repeat them (the training program's "completed" carries no
        # max_steps, its "failed" and the trainer's "cancelled" no loss): the report takes them here.
        self.last_loss: float | None = None
        self.max_steps = max_steps
        self.deployment: dict[str, Any] | None = None  # the newest adapter.loaded / adapter.rejected

    def apply(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        update: dict[str, Any] = {}
        if event.get("max_steps"):
            update["total"] = self.max_steps = event["max_steps"]
        if event.get("step") is not None:
            update["completed"] = event["step"]
        if kind == "progress":
            update["stats"] = stats_text(event)
            self.last_loss = event.get("loss", self.last_loss)
        elif kind in ("queued", "started"):
            update["description"] = "queued" if kind == "queued" else "training"
        elif kind == "checkpoint" and event.get("checkpoint"):
            cp = event["checkpoint"]
            self.progress.console.print(f"checkpoint at step {cp.get('step')}: {escape(str(cp.get('path')))}",
                                        highlight=False, soft_wrap=True)
        elif kind in TERMINAL_KINDS:
            update["description"] = kind
        elif kind in (LOADED, REJECTED):
            self.deployment = event
            self.progress.console.print(deployment_text(event), highlight=False, soft_wrap=True)
            return  # a replica's step is not the job's progress
        self.progress.update(self.task, **update)


def deployment_text(event: dict[str, Any]) -> str:
    replica = f"replica {escape(str(event['replica']))}" if event.get("replica") else "the checkpoint-watcher"
    if event.get("kind") == LOADED:
        seconds = event.get("latency_s")
        latency = f" {seconds:.2f} s after it was written" if isinstance(seconds, (int, float)) else ""
        return f"[green]served[/]: {replica} loaded step {event.get('step')}{latency}"
    return (f"[red]not served[/]: {replica} refused step {event.get('step')}: "
            f"{escape(str(event.get('reason') or 'no reason given'))}")


def _final_from_status(job: dict[str, Any]) -> dict[str, Any]:
    """A terminal event made from the job's status, for when the stream ended without one."""
    status = job.get("job_status", {})
    history = status.get("history") or []
    return {"kind": str(status.get("status", "")).lower(), "step": status.get("step"),
            "max_steps": status.get("max_steps"), "error": status.get("error"),
            "loss": history[-1].get("loss") if history else None}


def follow(gateway: Gateway, job: str, console: Console) -> int:
    """Follow ``job`` (a hash, a prefix or ``latest``) to its end: 0 if it completed, 1 if not."""
    info = gateway.get_job(job)  # resolves prefixes and gives the bar its total before any event
    status = info.get("job_status", {})
    job_hash = status.get("model_name") or job
    total = status.get("max_steps") or info.get("job_config", {}).get("max_steps")
    columns = (TextColumn("{task.description:>9}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[stats]}"), TimeElapsedColumn())
    final: dict[str, Any] | None = None
    last_seq, failures = -1, 0
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(str(status.get("status", "")).lower() or "waiting", total=total,
                                 completed=status.get("step") or 0, stats="")
        display = _Display(progress, task, total)
        while final is None:
            try:
                for event in gateway.events(job_hash):
                    # After a reconnect the stream replays history: seq tells what was shown.
                    seq = event.get("seq")
                    if isinstance(seq, int):
                        if seq <= last_seq:
                            continue
                        last_seq = seq
                    failures = 0
                    display.apply(event)
                    if event.get("kind") in TERMINAL_KINDS:
                        # Read on: the stream still brings the deployment of the job's last
                        # checkpoint, then the gateway ends it.
                        final = event
                if final is None:
                    # The stream ended early (gateway restart, idle proxy): the job may be over.
                    info = gateway.get_job(job_hash)
                    if info.get("job_status", {}).get("status") in FINISHED_STATUSES:
                        final = _final_from_status(info)
                        display.apply(final)
                        break
                    failures += 1
            except CliError as exc:
                if exc.exit_code != EXIT_UNREACHABLE:
                    raise
                failures += 1
                if failures > MAX_RECONNECTS:
                    raise CliError(exc.message, f"the job keeps running; follow it again with "
                                   f"`loopline follow {short(job_hash)}`", EXIT_UNREACHABLE) from None
            if final is None:
                if failures > MAX_RECONNECTS:
                    raise CliError(f"the event stream of {short(job_hash)} keeps ending before the job does",
                                   f"check `loopline status {short(job_hash)}`", EXIT_FAILED)
                time.sleep(min(0.5 * 2 ** failures, 8.0))
    known = {"loss": display.last_loss, "max_steps": display.max_steps}
    final = {**final, **{key: value for key, value in known.items() if final.get(key) is None}}
    return report(final, job_hash, console, display.deployment)


def report(final: dict[str, Any], job_hash: str, console: Console,
           deployment: dict[str, Any] | None = None) -> int:
    kind = final.get("kind")
    step = final.get("step")
    of = f"/{final['max_steps']}" if final.get("max_steps") else ""
    where = "the end" if step is None else f"step {step}{of}"
    if kind == "completed":
        loss = f", loss {final['loss']:.4f}" if final.get("loss") is not None else ""
        console.print(f"[green]completed[/] {job_hash} at {where}{loss}", highlight=False, soft_wrap=True)
        if deployment is not None and deployment.get("kind") == REJECTED:
            # Trained but not servable: a script that goes on to generate with it must stop here.
            console.print(f"no replica serves it: {escape(str(deployment.get('reason')))}; its checkpoints "
                          f"stay in the job's directory (`loopline status {short(job_hash)}`)",
                          highlight=False, soft_wrap=True)
            return EXIT_FAILED
        return 0
    error = f": {escape(str(final['error']))}" if final.get("error") else ""
    colour = "red" if kind == "failed" else "yellow"
    console.print(f"[{colour}]{kind}[/] {job_hash} at {where}{error}", highlight=False, soft_wrap=True)
    console.print(f"see `loopline logs {short(job_hash)}` for the job's log", highlight=False, soft_wrap=True)
    return EXIT_FAILED
