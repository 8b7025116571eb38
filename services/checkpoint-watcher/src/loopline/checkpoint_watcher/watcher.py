"""One job brought up to date: its new checkpoint folders announced, rejected or skipped.

Only a job's newest servable checkpoint is announced: CHECKPOINTS keeps one message per job, and a
replica only ever loads the latest, so when several appeared at once (the watcher was down, or a
rescan found them) the older ones are skipped, and a step older than the one announced is never
announced (that would move the job backwards). A corrupt newest one is rejected and the next
newest is tried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.object_store import ObjectStore
from prometheus_client import Counter, Histogram

from loopline.checkpoint_watcher import pack, publish, scan
from loopline.checkpoint_watcher.cursor import Cursors, JobCursor
from loopline.checkpoint_watcher.validate import Rejected
from loopline.common.runtime import adapter_retire

log = logging.getLogger(__name__)

CHECKPOINTS = Counter("loopline_checkpoints", (
    "Checkpoint folders handled, by outcome: announced (stored and published on CHECKPOINTS), "
    "rejected (not a servable adapter), skipped (a newer one of the same job was announced)."),
    ["outcome"])
# Seconds from the checkpoint's folder being written to its announcement: inotify makes it well
# under a second, a rescan (every rescan_interval_s) or a large adapter's upload longer.
PUBLISH_LATENCY = Histogram("loopline_checkpoint_publish_seconds", (
    "From a checkpoint being written to its announcement on CHECKPOINTS."),
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, float("inf")))


class CheckpointWatcher:
    def __init__(self, jobs_dir: Path, max_adapter_bytes: int, js: JetStreamContext, obs: ObjectStore,
                 cursors: Cursors):
        self.jobs_dir = jobs_dir
        self.max_adapter_bytes = max_adapter_bytes
        self.js = js
        self.obs = obs
        self.cursors = cursors
        # withdrawn: announced just as the job was deleted, then retired again (_withdraw_if_deleted).
        self.counts = {"announced": 0, "rejected": 0, "skipped": 0, "withdrawn": 0}
        self.last_announced: dict | None = None
        self._no_config: set[str] = set()  # jobs already warned about

    async def handle_job(self, job_hash: str) -> None:
        job_dir = self.jobs_dir / job_hash
        on_disk = await asyncio.to_thread(scan.step_dirs, job_dir)
        cursor = await self.cursors.get(job_hash)
        new = [s for s in on_disk if cursor.seen.get(s.step) != s.fingerprint]
        if not new:
            return
        job = await asyncio.to_thread(scan.watched_job, job_dir)
        if job is None:
            if job_hash not in self._no_config:
                log.warning("job %s: no readable config.json naming its model; its checkpoints wait",
                            job_hash)
                self._no_config.add(job_hash)
            return
        self._no_config.discard(job_hash)
        if cursor.identity != job.identity:
            # A new directory under this hash (deleted and submitted again): its steps start over.
            cursor, new = JobCursor(identity=job.identity), on_disk

        newest_first = sorted(new, key=lambda s: s.step, reverse=True)
        for i, step_dir in enumerate(newest_first):
            if step_dir.step < cursor.step:
                self._skip(cursor, step_dir)
                continue
            try:
                packed = await asyncio.to_thread(pack.pack, step_dir.path, step_dir.step,
                                                 self.max_adapter_bytes)
            except pack.Vanished:
                continue  # rotated away while we read it; a newer one exists
            except Rejected as exc:
                log.warning("job %s step %d rejected: %s", job_hash, step_dir.step, exc)
                await publish.reject(self.js, job_hash, step_dir, str(exc))
                cursor.seen[step_dir.step] = step_dir.fingerprint
                self.counts["rejected"] += 1
                CHECKPOINTS.labels("rejected").inc()
                continue
            try:
                # The same step rewritten with the same bytes (a resumed run) is already served.
                if (step_dir.step, packed.sha256) != (cursor.step, cursor.sha256):
                    message = await publish.announce(self.js, self.obs, job_hash, job.base_model,
                                                     step_dir, packed)
                    if message is not None:
                        self._announced(message)
                        await self._withdraw_if_deleted(job_hash, job_dir)
            finally:
                packed.data.close()
            cursor.step, cursor.sha256 = step_dir.step, packed.sha256
            cursor.seen[step_dir.step] = step_dir.fingerprint
            for older in newest_first[i + 1:]:
                self._skip(cursor, older)
            break

        steps = {s.step for s in on_disk}
        cursor.seen = {step: fp for step, fp in cursor.seen.items() if step in steps}
        await self.cursors.save(job_hash, cursor)

    async def _withdraw_if_deleted(self, job_hash: str, job_dir: Path) -> None:
        """The job was deleted while its checkpoint was read and announced: the delete's purge may
        have come before the announcement, so retire the job again (adapter_retire.py), which
        withdraws this announcement and its object too. The folder goes before the purge, so an
        announcement made after the purge always finds it gone here."""
        if await asyncio.to_thread(job_dir.is_dir):
            return
        log.warning("job %s was deleted while its checkpoint was announced; withdrawing it", job_hash)
        await adapter_retire.retire(self.js, job_hash)
        self.counts["withdrawn"] += 1

    def _skip(self, cursor: JobCursor, step_dir: scan.StepDir) -> None:
        cursor.seen[step_dir.step] = step_dir.fingerprint
        self.counts["skipped"] += 1
        CHECKPOINTS.labels("skipped").inc()

    def _announced(self, message) -> None:
        latency = message.announced_at - message.created_at
        log.info("job %s step %d announced (%s, %d bytes, %.0f ms after it was written)",
                 message.job_hash, message.step, message.adapter_type, message.size, latency * 1000)
        self.counts["announced"] += 1
        CHECKPOINTS.labels("announced").inc()
        PUBLISH_LATENCY.observe(latency)
        self.last_announced = {"job_hash": message.job_hash, "step": message.step,
                               "sha256": message.sha256, "latency_s": round(latency, 4),
                               "at": time.time()}
