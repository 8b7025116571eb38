"""One checkpoint folder -> the object the adapters store holds: validated, packed, hashed.

The object is an uncompressed tar of adapter_config.json and adapter_model.safetensors, members
sorted, owners and timestamps zeroed, so the same checkpoint always gives the same bytes and the
same sha256 (a restart recomputes it and finds it already stored and announced). training_state.pt
stays behind: only training needs it. No compression: float weights barely compress, and gzip
would stamp a time into the bytes.

Both files are opened once and everything (the checks, the copy) reads through those handles, so
what is stored is what was checked even if the folder is rotated away meanwhile. Blocking: run in
a thread.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from loopline.checkpoint_watcher import validate
from loopline.checkpoint_watcher.validate import Rejected
from loopline.common.contracts.adapter_format import CONFIG_FILE, WEIGHTS_FILE

# Objects up to this size are built in memory; larger ones (full weights) in a temp file.
IN_MEMORY_BYTES = 64 * 1024 * 1024


class Vanished(Exception):
    """The folder went away while we read it (rotated out): nothing to report."""


@dataclass
class Packed:
    data: BinaryIO  # the object's bytes, positioned at 0; close it when done
    sha256: str
    size: int
    adapter_type: str
    config: dict[str, Any]


def pack(step_dir: Path, step: int, max_adapter_bytes: int) -> Packed:
    """Raises ``Rejected`` (corrupt: report it) or ``Vanished`` (gone: forget it)."""
    try:
        # Opened apart from its `with`: only open()'s FileNotFoundError means the file is missing.
        config_f = open(step_dir / CONFIG_FILE, "rb")  # noqa: SIM115
    except FileNotFoundError as exc:
        raise _missing(step_dir, CONFIG_FILE) from exc
    with config_f:
        try:
            weights_f = open(step_dir / WEIGHTS_FILE, "rb")  # noqa: SIM115 - as config_f
        except FileNotFoundError as exc:
            raise _missing(step_dir, WEIGHTS_FILE) from exc
        with weights_f:
            raw_config = config_f.read(validate.MAX_CONFIG_BYTES + 1)
            config = validate.adapter_config(raw_config, step)
            size = os.fstat(weights_f.fileno()).st_size
            if size > max_adapter_bytes:
                raise Rejected(f"{WEIGHTS_FILE} has {size} bytes, more than the {max_adapter_bytes} allowed")
            validate.tensors_match(config, validate.safetensors_header(weights_f, size))
            out = _tar(raw_config, weights_f, size)
    sha, total = _digest(out)
    return Packed(out, sha, total, config["adapter_type"], config)


def _tar(raw_config: bytes, weights: BinaryIO, weights_size: int) -> BinaryIO:
    # Returned open: the caller uploads it, then closes it.
    out: BinaryIO = io.BytesIO() if weights_size < IN_MEMORY_BYTES else tempfile.TemporaryFile()  # noqa: SIM115
    try:
        with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            tar.addfile(_member(CONFIG_FILE, len(raw_config)), io.BytesIO(raw_config))
            weights.seek(0)
            tar.addfile(_member(WEIGHTS_FILE, weights_size), weights)
    except BaseException:
        out.close()
        raise
    out.seek(0)
    return out


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _digest(f: BinaryIO) -> tuple[str, int]:
    h, total = hashlib.sha256(), 0
    while chunk := f.read(1024 * 1024):
        h.update(chunk)
        total += len(chunk)
    f.seek(0)
    return h.hexdigest(), total


def _missing(step_dir: Path, name: str) -> Exception:
    if not step_dir.is_dir():
        return Vanished(str(step_dir))
    return Rejected(f"{name} is missing")
