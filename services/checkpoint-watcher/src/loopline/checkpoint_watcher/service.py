"""The checkpoint-watcher process: connect, answer svc.checkpoint_watcher.status, and turn each
finished checkpoint in the job directories into an adapter object plus a CHECKPOINTS announcement.

Its only state is the cursor in KV (cursor.py): it can be stopped at any moment, and on start it
rescans every job, so checkpoints written while it was down are announced and nothing already
announced is announced again. Run one replica: two would race on the same cursors.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time

from nats.micro import add_service
from nats.micro.request import Request

from loopline.checkpoint_watcher import scan
from loopline.checkpoint_watcher.cursor import Cursors
from loopline.checkpoint_watcher.watch import watch_jobs
from loopline.checkpoint_watcher.watcher import CheckpointWatcher
from loopline.common import bus, subjects
from loopline.common.schemas import ServiceStatus
from loopline.common.settings import CheckpointWatcherSettings
from loopline.common.telemetry import setup_tracing

log = logging.getLogger(__name__)

VERSION = "0.1.0"


async def run(settings: CheckpointWatcherSettings) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit status."""
    replica = settings.replica_id or f"{socket.gethostname()}-{os.getpid()}"
    setup_tracing("loopline-checkpoint-watcher", settings.otlp_endpoint)
    jobs_dir = settings.jobs_dir.resolve()
    jobs_dir.mkdir(parents=True, exist_ok=True)

    nc = await bus.connect(settings.nats_url, name=f"checkpoint-watcher-{replica}")
    js = nc.jetstream()
    await bus.ensure_topology(js)
    obs = await js.object_store(subjects.ADAPTERS_BUCKET)
    watcher = CheckpointWatcher(jobs_dir, settings.max_adapter_bytes, js, obs, await Cursors.open(js))

    # Jobs inotify says may have a new checkpoint; None in it means "rescan them all".
    dirty: set[str | None] = set()
    wake = asyncio.Event()
    stopping = asyncio.Event()

    def stop() -> None:
        stopping.set()
        wake.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)

    def changed(job_hash: str | None) -> None:
        dirty.add(job_hash)
        wake.set()

    scans = {"full": 0, "last_full_at": None, "last_full_s": None}

    async def status(req: Request) -> None:
        reply = ServiceStatus(service="checkpoint-watcher", replica=replica, detail={
            "jobs_dir": str(jobs_dir), "inotify": settings.inotify,
            "rescan_interval_s": settings.rescan_interval_s, "jobs": len(watcher.cursors),
            **watcher.counts, "last_announced": watcher.last_announced, "scans": scans,
        })
        await req.respond(reply.model_dump_json().encode())

    service = await add_service(nc, name=subjects.CHECKPOINT_WATCHER_SERVICE, version=VERSION,
                                description="Loopline checkpoint-watcher: job checkpoints -> adapters store",
                                metadata={"replica": replica, "jobs_dir": str(jobs_dir)})
    await service.add_endpoint(name="status", subject=subjects.SVC_CHECKPOINT_WATCHER_STATUS, handler=status)
    watching = asyncio.create_task(watch_jobs(jobs_dir, changed, stopping)) if settings.inotify else None
    log.info("checkpoint-watcher %s up: jobs in %s, inotify %s, rescan every %.2f s", replica, jobs_dir,
             "on" if settings.inotify else "off", settings.rescan_interval_s)

    # Invariant: every complete checkpoint folder (checkpoints/step-*) of every job directory with
    # a readable config.json is, once handled, either announced (its adapter object stored, then
    # checkpoints.<base>.<hash> published), rejected (events.adapters.<hash>.rejected, never
    # announced) or skipped as older than one announced for its job; the job's cursor in KV
    # records it only after that was published. A job is handled when inotify reports a change
    # in it and, whatever inotify says, at every rescan (the first at start). A job that failed
    # (NATS down) is tried again at the next rescan: nothing is recorded that was not published.
    next_rescan = 0.0
    while not stopping.is_set():
        timeout = max(0.0, next_rescan - time.monotonic())
        try:
            await asyncio.wait_for(wake.wait(), timeout=timeout)
        except asyncio.TimeoutError:
            pass
        if stopping.is_set():
            break
        wake.clear()
        batch, full = set(dirty), time.monotonic() >= next_rescan or None in dirty
        dirty.clear()
        started = time.monotonic()
        if full:
            batch = set(await asyncio.to_thread(scan.job_names, jobs_dir))
            next_rescan = started + settings.rescan_interval_s
        for job_hash in sorted(j for j in batch if j is not None):
            if stopping.is_set():
                break
            try:
                await watcher.handle_job(job_hash)
            except Exception:  # noqa: BLE001 - NATS down or a broken job: the next rescan retries it
                log.exception("job %s: not handled, retrying at the next rescan", job_hash)
        if full:
            scans["full"] += 1
            scans["last_full_at"] = time.time()
            scans["last_full_s"] = round(time.monotonic() - started, 4)

    log.info("checkpoint-watcher stopping")
    if watching is not None:
        await watching
    await service.stop()
    try:
        await nc.drain()
    except Exception as exc:  # noqa: BLE001 - already closed by a failed reconnect
        log.debug("drain: %s", exc)
    log.info("checkpoint-watcher stopped")
    return 0

