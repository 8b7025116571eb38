"""The checkpoint-watcher's main loop: hand each job that may have a new checkpoint to the watcher,
the jobs inotify reported (watch.py) as they come and every job at each rescan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from loopline.checkpoint_watcher import scan
from loopline.checkpoint_watcher.watcher import CheckpointWatcher

log = logging.getLogger(__name__)


class ScanLoop:
    def __init__(self, watcher: CheckpointWatcher, jobs_dir: Path, rescan_interval_s: float):
        self.watcher = watcher
        self.jobs_dir = jobs_dir
        self.rescan_interval_s = rescan_interval_s
        # Jobs inotify says may have a new checkpoint; None in it means "rescan them all".
        self._dirty: set[str | None] = set()
        self._wake = asyncio.Event()
        self.scans: dict[str, Any] = {"full": 0, "last_full_at": None, "last_full_s": None}

    def changed(self, job_hash: str | None) -> None:
        """Handle ``job_hash`` soon (every job when None): watch.py's callback."""
        self._dirty.add(job_hash)
        self._wake.set()

    async def run(self, stopping: asyncio.Event) -> None:
        """Handle jobs until ``stopping`` is set; a job in progress is finished first."""
        waking = asyncio.create_task(self._wake_on(stopping))
        try:
            await self._scan_until(stopping)
        finally:
            waking.cancel()

    async def _wake_on(self, stopping: asyncio.Event) -> None:
        await stopping.wait()
        self._wake.set()

    async def _scan_until(self, stopping: asyncio.Event) -> None:
        # Invariant: every complete checkpoint folder (checkpoints/step-*) of every job directory
        # with a readable config.json is, once handled, either announced (its adapter object
        # stored, then checkpoints.<base>.<hash> published), rejected (events.adapters.<hash>.
        # rejected, never announced) or skipped as older than one announced for its job; the job's
        # cursor in KV records it only after that was published. A job is handled when inotify
        # reports a change in it and, whatever inotify says, at every rescan (the first at start).
        # A job that failed (NATS down) is tried again at the next rescan: nothing is recorded
        # that was not published. The jobs directory that cannot be listed (permissions, a lost
        # volume) is no job's failure: it ends the loop, and the process with it.
        next_rescan = 0.0
        while not stopping.is_set():
            timeout = max(0.0, next_rescan - time.monotonic())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
            if stopping.is_set():
                break
            self._wake.clear()
            batch, full = set(self._dirty), time.monotonic() >= next_rescan or None in self._dirty
            self._dirty.clear()
            started = time.monotonic()
            if full:
                batch = set(await asyncio.to_thread(scan.job_names, self.jobs_dir))
                next_rescan = started + self.rescan_interval_s
            for job_hash in sorted(j for j in batch if j is not None):
                if stopping.is_set():
                    break
                try:
                    await self.watcher.handle_job(job_hash)
                except Exception:  # NATS down or a broken job: the next rescan retries it
                    log.exception("job %s: not handled, retrying at the next rescan", job_hash)
            if full:
                self.scans["full"] += 1
                self.scans["last_full_at"] = time.time()
                self.scans["last_full_s"] = round(time.monotonic() - started, 4)
