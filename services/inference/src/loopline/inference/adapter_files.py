"""Fetching one announced checkpoint from the ``adapters`` object store into a private folder.

The object is a tar of ``adapter_config.json`` and ``adapter_model.safetensors`` (CheckpointAnnounce).
Nothing in it is trusted: only those two names are written, as plain files, into a folder this
replica owns, so a crafted archive cannot write elsewhere (no paths, links or devices are honoured).
"""

from __future__ import annotations

import hashlib
import shutil
import tarfile
from pathlib import Path

from nats.js import JetStreamContext

from loopline.common.contracts import adapter_format, subjects
from loopline.common.contracts.job_schemas import CheckpointAnnounce
from loopline.common.runtime import objects

ARCHIVE_NAME = "adapter.tar"
# Where the two files land inside a version's folder; the engine may write beside it (vLLM's copy).
CHECKPOINT_DIR = "checkpoint"


class BadArchive(ValueError):
    """The stored object is not what the announce says (wrong hash or size, other members)."""


async def download(js: JetStreamContext, announce: CheckpointAnnounce, folder: Path) -> Path:
    """Write the object into ``folder/adapter.tar`` (streamed, chunk by chunk) and check it against
    the announce."""
    folder.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - one mkdir
    path = folder / ARCHIVE_NAME
    # Each chunk is written into the file from the event loop as it arrives.
    with open(path, "wb") as f:  # noqa: ASYNC230
        await objects.read_into(js, subjects.ADAPTERS_BUCKET, announce.object_name, f)
    size = path.stat().st_size
    digest = _sha256(path)
    if size != announce.size or digest != announce.sha256:
        raise BadArchive(f"object {announce.object_name}: {size} bytes, sha256 {digest[:12]}…; the "
                         f"announce says {announce.size} bytes, sha256 {announce.sha256[:12]}…")
    return path


def unpack(archive: Path, folder: Path) -> Path:
    """Extract the two adapter files from ``archive`` into ``folder/checkpoint``; returns that."""
    out = folder / CHECKPOINT_DIR
    out.mkdir(parents=True, exist_ok=False)
    wanted = set(adapter_format.FILES)
    found: set[str] = set()
    try:
        with tarfile.open(archive, mode="r:") as tar:
            for member in tar:
                name = member.name.removeprefix("./")
                if name not in wanted or not member.isfile() or name in found:
                    raise BadArchive(f"unexpected member {member.name!r} in the adapter archive")
                source = tar.extractfile(member)
                assert source is not None  # a regular file (isfile above) always has contents
                with source, open(out / name, "wb") as dest:
                    shutil.copyfileobj(source, dest)
                found.add(name)
    except tarfile.TarError as exc:
        raise BadArchive(f"not a readable tar: {exc}") from exc
    if found != wanted:
        raise BadArchive(f"the adapter archive lacks {sorted(wanted - found)}")
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
