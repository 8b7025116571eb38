"""``loopline``: submit, follow, inspect and plot training jobs through the gateway's HTTP API; the
Tinker API's sessions, runs and checkpoints under ``loopline tinker`` (tinker_commands.py); the
gateway's API keys under ``loopline keys`` (keys_commands.py).

Data (hashes, tables, log lines) goes to stdout; progress, notices and errors go to stderr, so
``HASH=$(loopline train data.jsonl --no-follow)`` works (console.py).
"""

from __future__ import annotations

import enum
import importlib.util
import json
import os
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from loopline.cli import archive, keys_commands, plot as plotting, tinker_commands
from loopline.cli.client import DEFAULT_URL, EXIT_FAILED, EXIT_USER, CliError, Gateway
from loopline.cli.console import Target, err, gateway, handles_errors, out
from loopline.cli.follow import FINISHED_STATUSES, follow as follow_job, short

app = typer.Typer(name="loopline",
                  help="Train, follow and inspect Loopline jobs over the gateway's HTTP API.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
app.add_typer(tinker_commands.app, name="tinker")
app.add_typer(keys_commands.app, name="keys")
STATUS_COLOURS = {"COMPLETED": "green", "FAILED": "red", "CANCELLED": "yellow", "TRAINING": "cyan"}


class Adapter(str, enum.Enum):
    # loopline.common.contracts.adapter_format.ADAPTER_TYPES (tests/common/test_contracts.py checks them).
    tokenformer = "tokenformer"
    lora = "lora"
    none = "none"


@app.callback()
def main(ctx: typer.Context,
         url: str = typer.Option(DEFAULT_URL, "--url", envvar="LOOPLINE_URL", help="the gateway's base URL"),
         api_key: str | None = typer.Option(None, "--api-key", envvar="LOOPLINE_API_KEY",
                                            help="one of the gateway's API keys, when it has them")):
    ctx.obj = Target(url, api_key)


def parse_param(text: str) -> tuple[list[str], Any]:
    """``key=value`` → (key path, value); the value is JSON when it parses (numbers, booleans,
    objects), else the plain string; dotted keys address nested args (``lora_config.r=16``)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise CliError(f"--param {text!r} is not key=value", "e.g. --param seed=42 --param lora_config.r=16",
                       EXIT_USER)
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return key.strip().split("."), parsed


def build_params(params: list[str], **named: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for text in params:
        path, value = parse_param(text)
        node = result
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise CliError(f"--param {text!r} sets a key inside {part!r}, which is not an object", None,
                               EXIT_USER)
        node[path[-1]] = value
    # Named options win over --param; only what was given is sent, so the server's defaults apply
    # and the job hash depends only on what the user chose.
    result.update({k: v for k, v in named.items() if v is not None})
    return result


@app.command()
@handles_errors
def train(ctx: typer.Context,
          data: Path = typer.Argument(..., help="JSONL file: one {\"input\", \"output\"} object per line"),
          model: str | None = typer.Option(None, "--model", "-m",
                                           help="base model; default: the served one"),
          adapter: Adapter | None = typer.Option(None, "--adapter", help="adapter to train"),
          steps: int | None = typer.Option(None, "--steps", min=1, help="max_steps"),
          lr: float | None = typer.Option(None, "--lr", min=0.0, help="learning_rate"),
          param: list[str] = typer.Option([], "--param", "-p",
                                          help="any train arg as key=value (repeatable)"),
          ml_dir: Path | None = typer.Option(None, "--ml-dir", exists=True, file_okay=False,
                                             help="training code to ship as the job's ml/"),
          follow: bool = typer.Option(True, "--follow/--no-follow", help="follow the job until it ends")):
    """Validate DATA, upload it and start a training job; prints the job hash."""
    params = build_params(param, llm_name=model, adapter_type=adapter.value if adapter else None,
                          max_steps=steps, learning_rate=lr)
    summary = archive.validate_jsonl(data, str(params.get("training_mode", "language_model")))
    gw = gateway(ctx)
    # Spooled: small datasets never touch the disk, large ones never fill the memory.
    with tempfile.SpooledTemporaryFile(max_size=64 << 20) as packed:
        archive.pack(data, packed, ml_dir)
        size = packed.tell()
        packed.seek(0)
        err.print(f"uploading {summary.examples} examples ({size / 1024:,.1f} KiB packed) to {gw.base_url}")
        response = gw.submit(packed, params)
    status = response.get("job_status", {})
    job_hash = status.get("model_name")
    if not job_hash:
        raise CliError(f"the gateway accepted the job but named no hash: {json.dumps(response)[:200]}")
    out.print(job_hash)
    err.print(f"job {short(job_hash)} is {status.get('status', '?')}", soft_wrap=True)
    if not follow:
        err.print(f"follow it with `loopline follow {short(job_hash)}`")
        return
    raise typer.Exit(follow_job(gw, job_hash, err))


@app.command()
@handles_errors
def follow(ctx: typer.Context, job: str = typer.Argument(..., help="job hash, a prefix of it, or latest")):
    """Show a job's progress until it ends: exit 0 if it completed, 1 if it failed or was cancelled."""
    raise typer.Exit(follow_job(gateway(ctx), job, err))


def _when(value: Any, short: bool = False) -> str:
    if isinstance(value, (int, float)) and value > 0:
        return datetime.fromtimestamp(value).strftime("%m-%d %H:%M" if short else "%Y-%m-%d %H:%M:%S")
    return str(value) if value else "-"


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _status(value: Any) -> str:
    text = str(value or "-")
    colour = STATUS_COLOURS.get(text)
    return f"[{colour}]{text}[/]" if colour else escape(text)


def _loss(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "-"


@app.command()
@handles_errors
def jobs(ctx: typer.Context):
    """List the training jobs, newest first."""
    models = gateway(ctx).list_models()
    if not models:
        err.print("no training jobs yet; start one with `loopline train DATA.jsonl`")
        return
    table = Table(box=None, pad_edge=False, header_style="bold")  # no borders: grep- and 80-column-friendly
    for name in ("job", "status", "step", "loss", "trained", "started", "served"):
        table.add_column(name, no_wrap=True)
    for m in models:
        step = f"{m.get('step') or 0}/{m['max_steps']}" if m.get("max_steps") else str(m.get("step") or 0)
        # A unique prefix names a job everywhere, and 12 characters keep the table in 80 columns.
        table.add_row(escape(short(str(m.get("name", "?")))), _status(m.get("status")), step,
                      _loss(m.get("loss")), _duration(m.get("train_time")),
                      _when(m.get("start_time"), short=True),
                      "yes" if m.get("deployed") else "refused" if m.get("deployment_error") else "")
    out.print(table)


@app.command()
@handles_errors
def status(ctx: typer.Context, job: str = typer.Argument(..., help="job hash, a prefix of it, or latest"),
           last: int = typer.Option(10, "--last", min=0, help="how many of the last losses to show")):
    """A job's summary and its last losses."""
    info = gateway(ctx).get_job(job)
    st, config = info.get("job_status", {}), info.get("job_config", {})
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")  # paths and hashes are copied from here: never cut them short
    rows = [("job", st.get("model_name")), ("status", None), ("model", config.get("llm_name")),
            ("adapter", config.get("adapter_type")),
            ("step", f"{st.get('step', 0)}/{st.get('max_steps') or config.get('max_steps') or '?'}"),
            ("started", _when(st.get("start_time"))), ("slurm job", st.get("job_id")),
            ("directory", st.get("job_directory")), ("deployed", "yes" if info.get("deployed") else "no")]
    for key, value in rows:
        grid.add_row(key, _status(st.get("status")) if key == "status" else escape(str(value or "-")))
    if st.get("error"):
        grid.add_row("error", f"[red]{escape(str(st['error']))}[/]")
    if info.get("deployment_error"):  # why a replica refused the newest checkpoint
        grid.add_row("not served", f"[red]{escape(str(info['deployment_error']))}[/]")
    out.print(grid)
    history = (st.get("history") or [])[-last:] if last else []
    if history:
        table = Table("step", "loss", "epoch", "time", title=f"last {len(history)} losses")
        for p in history:
            table.add_row(str(p.get("step")), _loss(p.get("loss")),
                          f"{p['epoch']:.2f}" if isinstance(p.get("epoch"), (int, float)) else "-",
                          _duration(p.get("time")))
        out.print(table)


@app.command()
@handles_errors
def logs(ctx: typer.Context, job: str = typer.Argument(..., help="job hash, a prefix of it, or latest"),
         follow: bool = typer.Option(False, "--follow", "-f", help="keep printing until the job ends"),
         start: int = typer.Option(0, "--from-line", min=0, help="first line number to print")):
    """Print a job's training log."""
    gw = gateway(ctx)
    last = start - 1
    for attempt in range(6 if follow else 1):
        # Without --follow, a quiet second means we have caught up with a running job's log.
        for record in gw.logs(job, max(last, start), follow, read_timeout=None if follow else 2.0):
            number = record.get("line_number", last + 1)
            if number <= last:
                continue  # a resumed stream starts again at the last line we printed
            last = number
            out.print(f"{number} {escape(str(record['line']).rstrip())}", soft_wrap=True)
        if not follow or gw.get_job(job).get("job_status", {}).get("status") in FINISHED_STATUSES:
            return
        time.sleep(min(2 ** attempt, 8))  # the stream ended before the job: the connection was cut
    raise CliError("the log stream keeps ending before the job does", f"check `loopline status {job}`")


def _control(ctx: typer.Context, action: str, done: str, job: str) -> None:
    result = gateway(ctx).control(action, job)
    if not result:
        raise CliError(f"the gateway could not {action} {job}", "see `loopline status` and the trainer's log")
    st = result.get("job_status", {}) if isinstance(result, dict) else {}
    out.print(f"{done} {escape(str(st.get('model_name', job)))} (status {_status(st.get('status'))})",
              soft_wrap=True)


@app.command()
@handles_errors
def cancel(ctx: typer.Context, job: str = typer.Argument(..., help="job hash or a prefix of it")):
    """Stop a queued or training job; its checkpoints stay."""
    _control(ctx, "cancel", "cancelled", job)


@app.command()
@handles_errors
def delete(ctx: typer.Context, job: str = typer.Argument(..., help="job hash or a prefix of it"),
           yes: bool = typer.Option(False, "--yes", "-y", help="do not ask")):
    """Stop a job and remove it with its checkpoints and adapter."""
    if not yes and sys.stdin.isatty():
        typer.confirm(f"delete job {job} with its checkpoints?", abort=True)
    _control(ctx, "delete", "deleted", job)


@app.command()
@handles_errors
def restart(ctx: typer.Context, job: str = typer.Argument(..., help="job hash or a prefix of it")):
    """Run a failed or cancelled job again, from its last checkpoint."""
    _control(ctx, "restart", "restarted", job)


@app.command()
@handles_errors
def squeue(ctx: typer.Context):
    """The scheduler's queue as the trainer sees it."""
    reply = gateway(ctx).squeue()
    out.print(escape(reply.get("squeue_output") or ""), soft_wrap=True)
    if reply.get("error_message"):
        raise CliError(f"squeue failed: {reply['error_message']}")


@app.command()
@handles_errors
def plot(ctx: typer.Context,
         job: str | None = typer.Argument(None, help="job hash, a prefix of it, or latest"),
         out_path: Path = typer.Option(Path("loss.png"), "--out", "-o", help="image file (.png, .svg, .pdf)"),
         from_file: Path | None = typer.Option(None, "--from-file",
                                               help="a job directory or its status.json: plot offline"),
         with_lr: bool = typer.Option(True, "--lr/--no-lr", help="learning rate from the job's events")):
    """Plot loss against step (and the learning rate) to an image."""
    lrs: list = []
    if from_file is not None:
        status_, job_hash, model = plotting.load_status_file(from_file)
    elif job is None:
        raise CliError("give a job hash, or --from-file for a local job directory", "see `loopline jobs`",
                       EXIT_USER)
    else:
        gw = gateway(ctx)
        info = gw.get_job(job)
        status_, job_hash = info.get("job_status", {}), info.get("job_status", {}).get("model_name") or job
        model = info.get("job_config", {}).get("llm_name")
        lrs = _learning_rates(gw, job_hash) if with_lr else []
    plotting.render(out_path, plotting.loss_points(status_), lrs, plotting.title_for(job_hash, model))
    out.print(f"wrote {escape(str(out_path))}")


def _learning_rates(gw: Gateway, job_hash: str, budget_s: float = 5.0) -> list:
    """The learning rate is only in the progress events: read the replayed history (the stream goes
    quiet or ends after it) within a small time budget, and plot without it if that fails."""
    events, deadline = [], time.monotonic() + budget_s
    try:
        for event in gw.events(job_hash, read_timeout=1.0):
            events.append(event)
            if time.monotonic() > deadline:
                break
    except CliError as exc:
        err.print(f"(no learning rate: {escape(exc.message)})", soft_wrap=True)
    return plotting.lr_points(events)


@app.command()
def up(model: str | None = typer.Option(None, "--model", help="model to serve (LOOPLINE_MODEL)"),
       port: int | None = typer.Option(None, "--port", help="gateway port (LOOPLINE_PORT)")):
    """Start the embedded stack (NATS, services, gateway) on this machine, as `make up` does."""
    if importlib.util.find_spec("loopline.common") is None:
        err.print("[red]error:[/] the Loopline services are not installed in this environment\n"
                  "  run `make up` in a Loopline checkout (it installs them)", soft_wrap=True)
        raise typer.Exit(EXIT_FAILED)
    if model:
        os.environ["LOOPLINE_MODEL"] = model
    if port:
        os.environ["LOOPLINE_PORT"] = str(port)
    sys.stdout.flush()
    # exec, not a child: Ctrl-C and SIGTERM reach the stack's own handler, which stops what it started.
    os.execv(sys.executable, [sys.executable, "-m", "loopline.common.local.up"])
