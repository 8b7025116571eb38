"""Staging for ScalarLM's chunked upload: one directory per upload under the state dir, one file per
verified chunk, assembled and checked at finalize.

The upload id is derived from what the client declares (sizes, total hash, params), so a client that
starts the same upload again resumes it: init answers with the chunks already received. Sessions idle
for longer than the TTL are removed. Staging is local to this gateway: behind several gateway
replicas, a chunked upload needs sticky sessions.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_ID = re.compile(r"^[0-9a-f]{32}$")
_COPY_BLOCK = 1024 * 1024


class UnknownUpload(Exception):
    pass


@dataclass
class UploadPlan:
    """What the client declared at init."""

    total_size: int
    total_hash: str
    chunk_size: int
    num_chunks: int
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def upload_id(self) -> str:
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    def chunk_length(self, index: int) -> int:
        if index < self.num_chunks - 1:
            return self.chunk_size
        return self.total_size - self.chunk_size * (self.num_chunks - 1)


class ChunkStaging:
    def __init__(self, root: Path, ttl_s: float):
        self.root = root
        self.ttl_s = ttl_s

    def _dir(self, upload_id: str) -> Path:
        # The id comes from a header: only our own hex ids may become a path.
        if not _ID.match(upload_id or ""):
            raise UnknownUpload(upload_id)
        return self.root / upload_id

    def open(self, plan: UploadPlan) -> tuple[str, list[int]]:
        """Start (or resume) an upload; returns its id and the chunks already received."""
        self.sweep()
        upload_id = plan.upload_id
        path = self.root / upload_id
        path.mkdir(parents=True, exist_ok=True)
        (path / "plan.json").write_text(json.dumps(asdict(plan)))
        return upload_id, self.received(upload_id)

    def plan(self, upload_id: str) -> UploadPlan:
        try:
            data = json.loads((self._dir(upload_id) / "plan.json").read_text())
        except (OSError, ValueError) as exc:
            raise UnknownUpload(upload_id) from exc
        return UploadPlan(**data)

    def received(self, upload_id: str) -> list[int]:
        return sorted(int(p.stem) for p in self._dir(upload_id).glob("*.chunk"))

    def new_part(self, upload_id: str) -> Path:
        """A private file to write an incoming chunk into before it is verified."""
        return self._dir(upload_id) / f"incoming-{uuid.uuid4().hex}"

    def accept(self, upload_id: str, index: int, part: Path) -> None:
        """A verified chunk takes its place (atomically: a retried chunk simply replaces it)."""
        os.replace(part, self._dir(upload_id) / f"{index}.chunk")
        os.utime(self._dir(upload_id) / "plan.json")  # activity: keeps the session from expiring

    def assemble(self, upload_id: str) -> tuple[Path, str, int]:
        """Concatenate the chunks in order; returns the file, its sha256 and its size."""
        directory = self._dir(upload_id)
        plan = self.plan(upload_id)
        out_path = directory / "archive"
        sha = hashlib.sha256()
        size = 0
        with open(out_path, "wb") as out:
            for index in range(plan.num_chunks):
                with open(directory / f"{index}.chunk", "rb") as chunk:
                    while block := chunk.read(_COPY_BLOCK):
                        sha.update(block)
                        size += len(block)
                        out.write(block)
        return out_path, sha.hexdigest(), size

    def discard(self, upload_id: str) -> None:
        shutil.rmtree(self._dir(upload_id), ignore_errors=True)

    def sweep(self) -> None:
        """Remove sessions idle for longer than the TTL."""
        if not self.root.is_dir():
            return
        cutoff = time.time() - self.ttl_s
        for path in self.root.iterdir():
            try:
                marker = path / "plan.json"
                last = marker.stat().st_mtime if marker.exists() else path.stat().st_mtime
            except OSError:
                continue
            if last < cutoff:
                shutil.rmtree(path, ignore_errors=True)
