"""Local stand-ins for the Hub datasets some cookbook recipes read, so those recipes run unmodified
and offline in the recipe matrix (tests/e2e/test_tinker_recipe_matrix.py).

A stand-in is a function that writes a few rows of the dataset's own columns as JSON lines, one file
a split, and returns ``{split: file}``. The recipe's process loads them through ``site/sitecustomize.py``,
which ``recipe_env`` puts on its ``PYTHONPATH``: it wraps ``datasets.load_dataset`` so that a repo id
in the table ``LOOPLINE_STANDINS`` names is read from its files with the ``json`` builder; every
other call goes to the Hub as before (and fails offline, which is what a missing stand-in should do).
Test support only: nothing here is part of the product.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

SITE = Path(__file__).resolve().parent / "site"
TABLE_VARIABLE = "LOOPLINE_STANDINS"

# Writes the stand-in's split files into the folder it is given; returns {split: file}.
StandIn = Callable[[Path], dict[str, Path]]


def key(repo_id: str, config: str | None = None) -> str:
    """How the table names a dataset: its repo id, with ``::config`` where the recipe names one."""
    return repo_id if config is None else f"{repo_id}::{config}"


def write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_table(folder: Path, standins: Mapping[str, StandIn]) -> Path:
    """Write every stand-in under ``folder`` and the table the shim reads; returns the table's path."""
    table: dict[str, dict[str, str]] = {}
    for name, write in standins.items():
        files = write(folder / name.replace("/", "__").replace("::", "--"))
        table[name] = {split: str(path) for split, path in files.items()}
    path = folder / "standins.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1))
    return path


def environment(table: Path) -> dict[str, str]:
    """What a recipe's process needs to read the stand-ins in ``table``."""
    return {"PYTHONPATH": str(SITE), TABLE_VARIABLE: str(table)}
