"""``loopline keys``: make, list, rotate and revoke the gateway's API keys in its keys file
(``LOOPLINE_API_KEYS_FILE``). A key is printed once, when made; the file keeps only its SHA-256.
The gateway reads the file again within a second of a change: no restart.

Run where the gateway's keys file is (the file's format is the gateway's: key_store.py), so this
needs the gateway installed, as ``loopline up`` does.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import importlib.util
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import typer
from rich.table import Table

from loopline.cli.client import EXIT_FAILED, EXIT_USER, CliError
from loopline.cli.console import err, handles_errors
from loopline.cli.tinker_commands import _print as print_unfolded

app = typer.Typer(help="API keys of a gateway: create, list, rotate, revoke (no restart needed).",
                  no_args_is_help=True)
FILE = typer.Option(..., "--file", envvar="LOOPLINE_API_KEYS_FILE",
                    help="the gateway's keys file (LOOPLINE_API_KEYS_FILE)")


class Scope(str, enum.Enum):
    # loopline.gateway.auth.scopes.SCOPES
    inference = "inference"
    training = "training"
    admin = "admin"


def _store():
    """The gateway's key_store module; the CLI alone (HTTP only) does not carry it."""
    if importlib.util.find_spec("loopline.gateway") is None:
        raise CliError("the Loopline gateway is not installed in this environment",
                       "run `loopline keys` where the gateway runs (or in a Loopline checkout's .venv)",
                       EXIT_FAILED)
    from loopline.gateway.auth import key_store
    return key_store


@contextlib.contextmanager
def _editing(path: Path) -> Iterator:
    """The file's keys, to change in place; written back whole when the block ends. A lock file
    beside it keeps two commands from losing each other's change."""
    store = _store()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        keys = _read(store, path)
        yield keys
        store.write_key_file(path, keys)


def _read(store, path: Path):
    try:
        return store.read_key_file(path)
    except store.KeyFileError as exc:
        raise CliError(str(exc), "fix or move the file; the gateway keeps the keys it read last",
                       EXIT_USER) from None


def _find(keys, name: str):
    for entry in keys.keys:
        if entry.name == name:
            return entry
    raise CliError(f"no key named {name!r}", "see `loopline keys list`", EXIT_USER)


@app.command()
@handles_errors
def create(name: str = typer.Option(..., "--name", help="who or what the key is for (unique)"),
           scope: list[Scope] = typer.Option(..., "--scope", "-s",
                                              help="inference, training or admin (repeatable)"),
           requests_per_minute: float | None = typer.Option(None, "--rpm", min=0.001,
                                                            help="request rate limit, per gateway"),
           burst: int | None = typer.Option(None, "--burst", min=1,
                                            help="requests allowed at once above the rate"),
           max_in_flight: int | None = typer.Option(None, "--max-in-flight", min=1,
                                                    help="requests in progress at once, per gateway"),
           file: Path = FILE):
    """Make a key; prints it once (stdout). Its SHA-256 goes to the file."""
    store = _store()
    key = store.new_key()
    try:
        entry = store.KeyEntry(name=name, sha256=store.key_hash(key), scopes=[s.value for s in scope],
                               requests_per_minute=requests_per_minute, burst=burst,
                               max_in_flight=max_in_flight, created_at=time.time())
    except ValueError as exc:
        raise CliError(f"--name {name!r}: letters, digits, '.', '_', '@' and '-', at most 64",
                       None, EXIT_USER) from exc
    with _editing(file) as keys:
        if any(e.name == name for e in keys.keys):
            raise CliError(f"a key named {name!r} exists", "`loopline keys rotate` replaces it", EXIT_USER)
        keys.keys.append(entry)
    print(key)  # plain: no terminal markup around what is pasted into a client
    err.print(f"key {name!r} ({', '.join(entry.scopes)}) added to {file}; this is the only time it is shown",
              soft_wrap=True)


@app.command()
@handles_errors
def rotate(name: str = typer.Argument(..., help="the key's name"), file: Path = FILE):
    """Replace a key's secret, keeping its name, scopes, limits and jobs; prints the new key once.
    The old one stops working within a second."""
    store = _store()
    key = store.new_key()
    with _editing(file) as keys:
        entry = _find(keys, name)
        entry.sha256 = store.key_hash(key)
        entry.created_at = time.time()
    print(key)  # plain: no terminal markup around what is pasted into a client
    err.print(f"key {name!r} rotated in {file}; the previous one no longer works", soft_wrap=True)


@app.command()
@handles_errors
def revoke(name: str = typer.Argument(..., help="the key's name"), file: Path = FILE):
    """Remove a key; the gateway refuses it within a second."""
    with _editing(file) as keys:
        keys.keys.remove(_find(keys, name))
    err.print(f"key {name!r} revoked in {file}", soft_wrap=True)


@app.command("list")
@handles_errors
def list_keys(file: Path = FILE):
    """The keys in the file: names, scopes, limits (never the keys)."""
    keys = _read(_store(), file)
    if not keys.keys:
        err.print(f"no keys in {file}; make one with `loopline keys create --name NAME --scope inference`")
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("NAME", "SCOPES", "RPM", "BURST", "MAX IN FLIGHT", "CREATED", "SHA256"):
        table.add_column(column, no_wrap=True)
    for e in keys.keys:
        table.add_row(e.name, ",".join(e.scopes), _or_dash(e.requests_per_minute), _or_dash(e.burst),
                      _or_dash(e.max_in_flight),
                      datetime.fromtimestamp(e.created_at).strftime("%Y-%m-%d %H:%M"), e.sha256[:12])
    print_unfolded(table)  # a row is one line, never cut at the terminal's width


def _or_dash(value: float | int | None) -> str:
    return "-" if value is None else f"{value:g}"
