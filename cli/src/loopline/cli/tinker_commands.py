"""``loopline tinker``: the Tinker API's sessions, training runs and checkpoints as tables (the
gateway's ``/api/v1`` routes, the ones the ``tinker`` SDK reads), its session events as they happen
(``/v1/tinker/*/events``), and a tinker-cookbook run's ``metrics.jsonl`` as curves."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from loopline.cli import plot as plotting
from loopline.cli.client import EXIT_USER, CliError
from loopline.cli.console import err, gateway, handles_errors, out
from loopline.cli.tinker_follow import follow_sessions
from loopline.cli.tinker_metrics import post_metrics

app = typer.Typer(help="Tinker API sessions: runs, checkpoints, live events, cookbook metrics.",
                  no_args_is_help=True)
NO_SESSIONS = "point the tinker SDK at this gateway (docs/tinker.md) to start one"
LIMIT = typer.Option(20, "--limit", min=1, help="how many, newest first")
KEYS = typer.Option([], "--key", "-k", help="a metric to plot (repeatable); default: "
                    f"{', '.join(plotting.DEFAULT_METRIC_KEYS)}, those the file has")


def _table(*columns: str) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")  # no borders: grep-friendly
    for name in columns:
        table.add_column(name, no_wrap=True)
    return table


def _print(table: Table) -> None:
    """Ids and paths are copied and grepped: a row is one line, never folded or cut at the
    terminal's width (a terminal wraps what is wider)."""
    width = Measurement.get(out, out.options.update_width(1 << 16), table).maximum
    Console(highlight=False, emoji=False, width=max(width, out.width)).print(table)


def _when(iso: Any) -> str:
    """The server's ISO time in local time, minute precision."""
    try:
        return datetime.fromisoformat(str(iso)).astimezone().strftime("%m-%d %H:%M")
    except ValueError:
        return "-"


def _size(n: Any) -> str:
    if not isinstance(n, int) or n <= 0:
        return "-"
    size, units = float(n), ["B", "KiB", "MiB", "GiB"]
    # Invariant: size is n in units[0]; the first unit it is under 1024 of (or the largest) ends it.
    while size >= 1024 and len(units) > 1:
        size, units = size / 1024, units[1:]
    return f"{size:,.0f} B" if units[0] == "B" else f"{size:,.1f} {units[0]}"


@app.command()
@handles_errors
def sessions(ctx: typer.Context, limit: int = LIMIT):
    """List the sessions (one SDK ServiceClient each), newest first, with their training runs."""
    gw = gateway(ctx)
    ids = gw.tinker_sessions(limit)
    if not ids:
        err.print(f"no Tinker sessions yet; {NO_SESSIONS}")
        return
    table = _table("session", "runs", "training runs", "metadata")
    for session_id in ids:
        info = gw.tinker_session(session_id)
        runs = info.get("training_run_ids") or []
        meta = ", ".join(f"{k}={v}" for k, v in (info.get("user_metadata") or {}).items())
        table.add_row(escape(session_id), str(len(runs)), escape(" ".join(runs) or "-"), escape(meta or "-"))
    _print(table)


@app.command()
@handles_errors
def runs(ctx: typer.Context, limit: int = LIMIT,
         offset: int = typer.Option(0, "--offset", min=0, help="skip this many of the newest")):
    """List the training runs (one SDK training client each), newest first."""
    page = gateway(ctx).tinker_runs(limit, offset)
    found, total = page.get("training_runs") or [], (page.get("cursor") or {}).get("total_count")
    if not found:
        err.print(f"no Tinker training runs{' here' if offset else ' yet'}; {NO_SESSIONS}")
        return
    table = _table("run", "base model", "rank", "last request", "last sampler save", "last state save")
    for run in found:
        sampler, state = run.get("last_sampler_checkpoint") or {}, run.get("last_checkpoint") or {}
        name = escape(str(run.get("training_run_id")))
        table.add_row(f"[red]{name} (failed)[/]" if run.get("corrupted") else name,
                      escape(str(run.get("base_model"))), str(run.get("lora_rank") or "-"),
                      _when(run.get("last_request_time")), escape(sampler.get("checkpoint_id") or "-"),
                      escape(state.get("checkpoint_id") or "-"))
    _print(table)
    if isinstance(total, int) and offset + len(found) < total:
        err.print(f"runs {offset + 1}-{offset + len(found)} of {total}; "
                  f"see more with --offset {offset + len(found)}")


@app.command()
@handles_errors
def checkpoints(ctx: typer.Context, run_id: str = typer.Argument(..., help="a training run's id")):
    """List a training run's saved checkpoints: state (save_state) and sampler weights."""
    found = gateway(ctx).tinker_checkpoints(run_id)
    if not found:
        err.print(f"run {escape(run_id)} has no checkpoints yet: save_state and save_weights_for_sampler "
                  "make them")
        return
    table = _table("checkpoint", "type", "saved", "size", "expires", "tinker path")
    for cp in found:
        table.add_row(escape(str(cp.get("checkpoint_id"))), escape(str(cp.get("checkpoint_type"))),
                      _when(cp.get("time")), _size(cp.get("size_bytes")),
                      _when(cp.get("expires_at")) if cp.get("expires_at") else "never",
                      escape(str(cp.get("tinker_path"))))
    _print(table)


@app.command()
@handles_errors
def follow(ctx: typer.Context,
           run_id: str | None = typer.Argument(None, help="a training run's id; none: every session worker"),
           worker: str | None = typer.Option(None, "--worker", help="one session worker's events instead"),
           history: bool = typer.Option(False, "--history",
                                        help="every worker: the stored events first, not only new ones")):
    """Print session events (created, step and loss, saved, released, failed) as they happen: a
    run's or a worker's until it ends (exit 0 released, 1 failed), every worker's until Ctrl-C."""
    if run_id is not None and worker is not None:
        raise CliError("give a run id or --worker, not both", "a run's events include its worker's end",
                       EXIT_USER)
    try:
        code = follow_sessions(gateway(ctx), out, run_id, worker, history)
    except KeyboardInterrupt:
        code = 130  # the way to stop following every worker: nothing is wrong
    raise typer.Exit(code)


@app.command()
@handles_errors
def plot(metrics: Path = typer.Argument(..., help="a tinker-cookbook metrics.jsonl, or its log_path"),
         key: list[str] = KEYS,
         out_path: Path = typer.Option(Path("metrics.png"), "--out", "-o",
                                       help="image file (.png, .svg, .pdf)")):
    """Plot a cookbook run's metrics against its step, one panel a metric, to an image."""
    series, x_label, skipped = plotting.load_metrics(metrics, key)
    if skipped:
        err.print(f"(skipped {skipped} line(s) that are not JSON objects)")
    folder = metrics if metrics.is_dir() else metrics.resolve().parent
    plotting.render_metrics(out_path, series, x_label, f"{folder.name} — {plotting.METRICS_FILE}")
    out.print(f"wrote {escape(str(out_path))}")


@app.command()
@handles_errors
def metrics(ctx: typer.Context, run_id: str = typer.Argument(..., help="the training run the metrics are of"),
            metrics_file: Path = typer.Argument(..., help="a tinker-cookbook metrics.jsonl, or its log_path"),
            key: list[str] = KEYS,
            follow: bool = typer.Option(False, "--follow", "-f", help="keep posting new steps until Ctrl-C")):
    """Send a cookbook run's metrics to the gateway, each step once, for the dashboard's curves
    (/ui/runs/<run>)."""
    try:
        posted = post_metrics(gateway(ctx), out, run_id, metrics_file, key, follow)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    out.print(f"posted {posted} step(s) to run {escape(run_id)}")
