#!/usr/bin/env python3
"""``loopline-gateway-keys`` (in the gateway image): docker compose's gateway comes up keyed.

    loopline-gateway-keys start [--keys-file FILE] --open-gateway VALUE -- python -m loopline.gateway

Keyed, the default: the first start makes one key with every scope (named ``admin``), writes its
SHA-256 to FILE (the gateway's ``LOOPLINE_API_KEYS_FILE``, on a volume of its own) and prints the key
once, on stdout; a later start finds the file and makes none (a file whose keys were all revoked
stays so: every request is 401 until one is made). Then it runs the command with
``LOOPLINE_API_KEYS_FILE=FILE``. Open: ``--open-gateway 1`` (compose's ``LOOPLINE_OPEN_GATEWAY=1``)
runs the command with no keys at all, anyone who reaches the port may use everything, and says so
on every start. Any other value is refused, so a typo never opens the gateway.

    loopline-gateway-keys create [--keys-file FILE] --name NAME --scope inference [--scope training]

FILE defaults to ``LOOPLINE_API_KEYS_FILE``. ``create`` adds a key (printed once), as ``loopline keys
create`` does from a checkout; ``loopline keys`` there lists, rotates and revokes them in the same
file. The gateway reads the file again within a second of a change. The file's format is the
gateway's (``loopline.gateway.auth.key_store``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

KEYS_FILE_VARIABLE = "LOOPLINE_API_KEYS_FILE"
PLAIN_KEYS_VARIABLE = "LOOPLINE_API_KEYS"
OPEN_VALUES = {"1", "true", "yes"}
KEYED_VALUES = {"", "0", "false", "no"}
FIRST_KEY_NAME = "admin"
OPEN_WARNING = ("loopline-gateway-keys: LOOPLINE_OPEN_GATEWAY=1: the gateway runs WITHOUT API keys; "
                "anyone who reaches its port can run inference, train and cancel or delete every job. "
                "Unset LOOPLINE_OPEN_GATEWAY to have a key made on the next start.")


class Refused(Exception):
    """What the operator must change (the message says what); exit status 2."""


def open_gateway(value: str) -> bool:
    """Whether ``value`` (LOOPLINE_OPEN_GATEWAY) asks for a gateway without keys."""
    normal = value.strip().lower()
    if normal in OPEN_VALUES:
        return True
    if normal in KEYED_VALUES:
        return False
    raise Refused(f"LOOPLINE_OPEN_GATEWAY={value!r}: say 1 to run the gateway without API keys, or "
                  "leave it unset")


@contextlib.contextmanager
def locked(keys_file: Path) -> Iterator[None]:
    """One writer of the file at a time (the lock file `loopline keys` takes too)."""
    keys_file.parent.mkdir(parents=True, exist_ok=True)
    with open(keys_file.with_name(keys_file.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def add_key(keys_file: Path, name: str, scopes: list[str], *, first: bool = False) -> str | None:
    """Make a key, add its SHA-256 to the file, and return the key (nowhere else is it kept). With
    ``first``: only while there is no file (the first start), else None."""
    from loopline.gateway.auth import key_store  # the gateway's, so the format is one

    key = key_store.new_key()
    try:
        entry = key_store.KeyEntry(name=name, sha256=key_store.key_hash(key), scopes=scopes,
                                   created_at=time.time())
    except ValueError as exc:
        raise Refused(f"--name {name!r} / --scope {scopes}: {exc}") from None
    with locked(keys_file):
        if first and keys_file.exists():
            return None
        try:
            keys = key_store.read_key_file(keys_file)
        except key_store.KeyFileError as exc:
            raise Refused(f"{exc}: fix or move the file") from None
        if any(e.name == name for e in keys.keys):
            raise Refused(f"a key named {name!r} exists in {keys_file}")
        keys.keys.append(entry)
        key_store.write_key_file(keys_file, keys)
    return key


def start(keys_file: Path, open_value: str, command: list[str]) -> list[str]:
    """Set this process's environment up for ``command`` (making the first key if it is the first
    start) and return the command to run."""
    if not command:
        raise Refused("no command to run after --")
    if open_gateway(open_value):
        if os.environ.get(PLAIN_KEYS_VARIABLE, "").strip():
            raise Refused(f"LOOPLINE_OPEN_GATEWAY=1 and {PLAIN_KEYS_VARIABLE} are both set: choose one")
        os.environ.pop(KEYS_FILE_VARIABLE, None)
        print(OPEN_WARNING, file=sys.stderr, flush=True)
        return command
    key = add_key(keys_file, FIRST_KEY_NAME, ["admin"], first=True)  # admin: every scope
    if key is not None:
        print("=" * 78, f"Loopline's first API key (every scope, named {FIRST_KEY_NAME!r}); shown this once:",
              "", f"    {key}", "",
              "Clients send it as 'Authorization: Bearer <key>' (the Tinker SDK: X-API-Key).",
              f"Its SHA-256 is in {keys_file}. More keys: docker compose exec gateway",
              "  loopline-gateway-keys create --name NAME --scope inference", "=" * 78,
              sep="\n", flush=True)
    else:
        print(f"loopline-gateway-keys: API keys on, from {keys_file} (no key is made: the file exists)",
              file=sys.stderr, flush=True)
    os.environ[KEYS_FILE_VARIABLE] = str(keys_file)
    return command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loopline-gateway-keys", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    # The file: --keys-file, else the container's LOOPLINE_API_KEYS_FILE (compose sets it).
    keys_file = {"type": Path, "default": os.environ.get(KEYS_FILE_VARIABLE) or None,
                 "required": not os.environ.get(KEYS_FILE_VARIABLE)}
    start_parser = commands.add_parser("start", help="make the first key if none, then run the gateway")
    start_parser.add_argument("--keys-file", **keys_file)  # type: ignore[arg-type]
    start_parser.add_argument("--open-gateway", default="", metavar="VALUE",
                              help="1: no API keys at all (LOOPLINE_OPEN_GATEWAY)")
    start_parser.add_argument("gateway", nargs=argparse.REMAINDER, help="-- the gateway's command")
    create_parser = commands.add_parser("create", help="add a key; prints it once")
    create_parser.add_argument("--keys-file", **keys_file)  # type: ignore[arg-type]
    create_parser.add_argument("--name", required=True)
    create_parser.add_argument("--scope", action="append", required=True,
                               choices=["inference", "training", "admin"])
    args = parser.parse_args(argv)
    try:
        if args.command == "create":
            print(add_key(args.keys_file, args.name, args.scope), flush=True)
            return 0
        command = start(args.keys_file, args.open_gateway,
                        args.gateway[1:] if args.gateway[:1] == ["--"] else args.gateway)
    except Refused as exc:
        print(f"loopline-gateway-keys: {exc}", file=sys.stderr)
        return 2
    os.execvp(command[0], command)
    return 1  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
