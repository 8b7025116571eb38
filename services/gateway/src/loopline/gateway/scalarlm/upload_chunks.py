"""Staging for ScalarLM's chunked upload, kept in NATS: the ``uploads`` object store holds each
upload's plan (``<upload id>/plan``) and its verified chunks (``<upload id>/<index>``).

Any gateway takes any chunk and any finalizes: behind several gateway replicas a client needs no
sticky session (chunk 0 to one gateway, chunk 1 to another, finalize on a third). The upload id is
derived from what the client declares (sizes, total hash, params), so a client that starts the same
upload again resumes it: init answers with the chunks already received, whichever gateway has them.

The store's objects live ``upload_ttl_s`` from when they were written: a chunk is stored once, the
plan again at each accepted chunk, so an upload that stalls longer than the TTL loses its oldest
chunks (finalize then names them as missing, and the client sends them again). Give every gateway
the same LOOPLINE_UPLOAD_TTL_S: each brings the store to its own at start.

A chunk is written to a private temporary file as it arrives, checked against its hash, and only
then stored; finalize assembles into another temporary file. Both are unlinked at once (no name
stays on disk), so nothing of an upload is left on the gateway that handled it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from loopline.common.contracts import subjects
from loopline.common.runtime import bus, objects

_ID = re.compile(r"^[0-9a-f]{32}$")
_HASH_BLOCK = 1024 * 1024


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
    # The API key that began it (gateway/auth/tenancy.py): part of the id, so another key declaring
    # the same archive has an upload of its own, and cannot send to or finalize this one.
    owner: str | None = None

    @property
    def upload_id(self) -> str:
        declared = asdict(self)
        if self.owner is None:  # without keys, the id it always had
            del declared["owner"]
        canonical = json.dumps(declared, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    def chunk_length(self, index: int) -> int:
        if index < self.num_chunks - 1:
            return self.chunk_size
        return self.total_size - self.chunk_size * (self.num_chunks - 1)


def plan_object(upload_id: str) -> str:
    return f"{upload_id}/plan"


def chunk_object(upload_id: str, index: int) -> str:
    return f"{upload_id}/{index}"


class ChunkStaging:
    def __init__(self, root: Path, ttl_s: float):
        self.root = root  # where this gateway's temporary files are (never a name left there)
        self.ttl_s = ttl_s
        self._store: ObjectStore | None = None
        self._opening = asyncio.Lock()

    async def store(self, js: JetStreamContext) -> ObjectStore:
        """The uploads object store, brought to this gateway's TTL once per process."""
        async with self._opening:
            if self._store is None:
                await asyncio.to_thread(self.root.mkdir, parents=True, exist_ok=True)
                await bus.ensure_object_store(js, subjects.UPLOADS_BUCKET, self.ttl_s)
                self._store = await js.object_store(subjects.UPLOADS_BUCKET)
            return self._store

    @staticmethod
    def _checked(upload_id: str) -> str:
        # The id comes from a header: only our own hex ids may name an object.
        if not _ID.match(upload_id or ""):
            raise UnknownUpload(upload_id)
        return upload_id

    def new_part(self) -> IO[bytes]:
        """A private, nameless file to write an incoming chunk into before it is verified."""
        return tempfile.TemporaryFile(dir=self.root)

    async def open(self, js: JetStreamContext, plan: UploadPlan) -> tuple[str, list[int]]:
        """Start (or resume) an upload; returns its id and the chunks already received."""
        store = await self.store(js)
        upload_id = plan.upload_id
        await store.put(plan_object(upload_id), json.dumps(asdict(plan)).encode())
        return upload_id, await self.received(js, upload_id, plan)

    async def plan(self, js: JetStreamContext, upload_id: str) -> UploadPlan:
        await self.store(js)  # the bucket, on a first call
        try:
            found = await objects.read_bytes(js, subjects.UPLOADS_BUCKET,
                                             plan_object(self._checked(upload_id)))
            return UploadPlan(**json.loads(found or b""))
        except (NotFoundError, ValueError, TypeError) as exc:
            raise UnknownUpload(upload_id) from exc

    async def received(self, js: JetStreamContext, upload_id: str, plan: UploadPlan) -> list[int]:
        store = await self.store(js)

        async def has(index: int) -> bool:
            try:
                info = await store.get_info(chunk_object(upload_id, index))
            except NotFoundError:  # also a deleted one
                return False
            return info.size == plan.chunk_length(index)

        present = await asyncio.gather(*(has(i) for i in range(plan.num_chunks)))
        return [index for index, there in enumerate(present) if there]

    async def accept(self, js: JetStreamContext, upload_id: str, plan: UploadPlan, index: int,
                     part: IO[bytes]) -> None:
        """A verified chunk takes its place (a retried chunk simply replaces it); the plan is
        written again, so the upload lives ``ttl_s`` past its latest chunk."""
        store = await self.store(js)
        part.seek(0)
        await store.put(chunk_object(upload_id, index), part)  # type: ignore[arg-type]
        await store.put(plan_object(upload_id), json.dumps(asdict(plan)).encode())

    async def assemble(self, js: JetStreamContext, upload_id: str,
                       plan: UploadPlan) -> tuple[IO[bytes], str, int]:
        """The chunks concatenated in order into a temporary file (at its start; the caller closes
        it), with its sha256 and size."""
        await self.store(js)
        out = tempfile.TemporaryFile(dir=self.root)  # noqa: SIM115 - returned open
        try:
            # Invariant: ``out`` holds chunks 0..index-1, in order.
            for index in range(plan.num_chunks):
                await objects.read_into(js, subjects.UPLOADS_BUCKET, chunk_object(upload_id, index), out)
            out.seek(0)
            sha, size = await asyncio.to_thread(_digest, out)
        except BaseException:
            out.close()
            raise
        return out, sha, size

    async def discard(self, js: JetStreamContext, upload_id: str) -> None:
        await bus.purge_objects(js, subjects.UPLOADS_BUCKET, f"{self._checked(upload_id)}/")


def _digest(f: IO[bytes]) -> tuple[str, int]:
    sha, size = hashlib.sha256(), 0
    while block := f.read(_HASH_BLOCK):
        sha.update(block)
        size += len(block)
    f.seek(0)
    return sha.hexdigest(), size
