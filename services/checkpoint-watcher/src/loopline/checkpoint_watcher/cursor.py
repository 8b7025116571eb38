"""The watcher's only state: per job, what it announced and which checkpoint folders it handled.

Kept in a JetStream KV bucket (one key per job hash), not in a file under state_dir, because:
the deployments give the watcher no volume of its own (compose mounts only the jobs volume; a
local file would be lost with the container, and every checkpoint republished); NATS is already
where the announcements live, so cursor and stream are lost or kept together; and a replacement
replica on another node (Kubernetes reschedules it) picks up where the old one stopped.

The cursor is saved after the announcement it records, so a crash in between can leave it one
announcement behind; the watcher then finds that announcement as the last message of the job's
subject and does not repeat it (see publish.py).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from loopline.common.contracts import subjects

log = logging.getLogger(__name__)


@dataclass
class JobCursor:
    identity: str = ""  # scan.WatchedJob.identity of the job directory this describes
    step: int = -1  # the last step announced (-1: none yet)
    sha256: str = ""  # of that announcement's object
    # step -> fingerprint of each checkpoint folder handled (announced, rejected or skipped as
    # older than the one announced); only steps still on disk are kept.
    seen: dict[int, str] = field(default_factory=dict)

    def copy(self) -> JobCursor:
        return replace(self, seen=dict(self.seen))


class Cursors:
    """Cursors by job hash: read from KV on first use, then kept in memory (one writer)."""

    def __init__(self, kv: KeyValue):
        self._kv = kv
        self._cache: dict[str, JobCursor] = {}

    @classmethod
    async def open(cls, js: JetStreamContext) -> Cursors:
        try:
            kv = await js.key_value(subjects.CHECKPOINT_CURSOR_BUCKET)
        except (BucketNotFoundError, NotFoundError):
            kv = await js.create_key_value(KeyValueConfig(
                bucket=subjects.CHECKPOINT_CURSOR_BUCKET, history=1, storage=StorageType.FILE))
        return cls(kv)

    def __len__(self) -> int:
        return len(self._cache)

    async def get(self, job_hash: str) -> JobCursor:
        """A copy: the caller changes it and saves it once its work is published."""
        if job_hash not in self._cache:
            self._cache[job_hash] = await self._load(job_hash)
        return self._cache[job_hash].copy()

    async def save(self, job_hash: str, cursor: JobCursor) -> None:
        if self._cache.get(job_hash) == cursor:
            return
        data = asdict(cursor)
        data["seen"] = {str(k): v for k, v in cursor.seen.items()}
        await self._kv.put(job_hash, json.dumps(data, sort_keys=True).encode())
        self._cache[job_hash] = cursor.copy()

    async def _load(self, job_hash: str) -> JobCursor:
        try:
            entry = await self._kv.get(job_hash)
        except NotFoundError:  # never saved, or deleted (KeyDeletedError is no KeyNotFoundError)
            return JobCursor()
        try:
            data = json.loads(entry.value or b"{}")
            return JobCursor(identity=data["identity"], step=data["step"], sha256=data["sha256"],
                             seen={int(k): v for k, v in data["seen"].items()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # Starting over is safe: nothing already announced is announced again (publish.py).
            log.warning("cursor of job %s unreadable (%s); starting it over", job_hash, exc)
            return JobCursor()
