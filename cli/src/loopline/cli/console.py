"""What every ``loopline`` command shares: where output goes, the gateway it talks to, and how a
failure becomes one message and an exit code.

Data (hashes, tables, log lines) goes to stdout; progress, notices and errors go to stderr, so
``HASH=$(loopline train data.jsonl --no-follow)`` works.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import typer
from rich.console import Console
from rich.markup import escape

from loopline.cli import archive
from loopline.cli.client import EXIT_USER, CliError, Gateway

# No emoji codes: a Tinker model id holds ":train:", which rich would print as a train.
out = Console(highlight=False, emoji=False)
err = Console(stderr=True, highlight=False, emoji=False)


@dataclass(frozen=True)
class Target:
    """The gateway the global options name (``ctx.obj``)."""

    url: str
    api_key: str | None = None


def handles_errors(command):
    """Every command ends in one of our messages and exit codes, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except CliError as exc:
            err.print(f"[red]error:[/] {escape(exc.message)}", soft_wrap=True)
            if exc.hint:
                err.print(f"  {escape(exc.hint)}", soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except archive.DatasetError as exc:
            err.print(f"[red]error:[/] the dataset is not valid JSONL for training:\n{escape(str(exc))}",
                      soft_wrap=True)
            err.print('  fix the line(s) above: each line must be one JSON object with "input" and "output" '
                      'strings (with --param training_mode=embedding: "sentence1", "sentence2", "score")',
                      soft_wrap=True)
            raise typer.Exit(EXIT_USER) from None
        except OSError as exc:  # a local file or directory we were pointed at
            what = f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)
            err.print(f"[red]error:[/] {escape(what)}", soft_wrap=True)
            raise typer.Exit(EXIT_USER) from None
        except KeyboardInterrupt:
            err.print("interrupted; a submitted job keeps running (`loopline jobs`)")
            raise typer.Exit(130) from None

    return wrapper


def gateway(ctx: typer.Context) -> Gateway:
    target: Target = ctx.find_root().obj
    gw = Gateway(target.url, api_key=target.api_key)
    ctx.call_on_close(gw.close)
    return gw
