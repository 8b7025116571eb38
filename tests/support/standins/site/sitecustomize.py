"""Loaded at start-up by a cookbook recipe's interpreter in the recipe matrix (support/standins):
``datasets.load_dataset`` reads the datasets the table in $LOOPLINE_STANDINS names from local JSON
lines files instead of the Hub. Installed before the recipe imports anything, so the recipe's own
``from datasets import load_dataset`` gets the wrapped function. Does nothing without the variable."""

import json
import os

_TABLE = os.environ.get("LOOPLINE_STANDINS")

if _TABLE:
    import datasets

    with open(_TABLE) as _file:
        _STANDINS = json.load(_file)
    _hub_load_dataset = datasets.load_dataset

    def _load_dataset(path, name=None, *args, split=None, **kwargs):
        files = _STANDINS.get(f"{path}::{name}") or _STANDINS.get(path)
        if files is None:
            return _hub_load_dataset(path, name, *args, split=split, **kwargs)
        loaded = _hub_load_dataset("json", data_files=files, split=split)
        if kwargs.get("streaming"):
            return loaded.to_iterable_dataset() if split is not None else loaded
        return loaded

    datasets.load_dataset = _load_dataset
