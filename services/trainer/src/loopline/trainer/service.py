"""The trainer service process: migrate the registry, connect, answer svc.trainer.* requests, and
reconcile the unfinished jobs every ``reconcile_interval_s`` until SIGTERM.

Its state is the SQL registry and the job directories; nothing lives only in memory, so it can be
stopped at any moment and started again (the reconcile loop picks up where the last one stopped).
Run it as one replica: two would both resubmit a job whose run ended.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket

from loopline.common import bus
from loopline.common.db.engine import open_database, migrate
from loopline.common.settings import TrainerSettings
from loopline.common.telemetry import setup_tracing
from loopline.trainer import jobdir
from loopline.trainer.control import JobControl
from loopline.trainer.endpoints import Endpoints
from loopline.trainer.events import EventPublisher
from loopline.trainer.launchers import make_launchers
from loopline.trainer.reconcile import reconcile_job, run_states
from loopline.trainer.registry import Registry

log = logging.getLogger(__name__)

# Requests in progress get this long after SIGTERM to finish.
SHUTDOWN_GRACE_S = 10.0


async def run(settings: TrainerSettings) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit status."""
    replica = f"{socket.gethostname()}-{os.getpid()}"
    setup_tracing("loopline-trainer", settings.otlp_endpoint)

    engine = open_database(settings.resolved_database_url())
    await asyncio.to_thread(migrate, engine)
    settings.jobs_dir.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(jobdir.clean_staging, settings.jobs_dir)

    nc = await bus.connect(settings.nats_url, name=f"trainer-{replica}")
    js = nc.jetstream()
    await bus.ensure_topology(js)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    launcher, launchers = make_launchers(settings.launcher, settings.jobs_dir.resolve(),
                                         partition=settings.slurm_partition,
                                         extra_args=settings.slurm_extra_args)
    registry = Registry(engine)
    control = JobControl(settings, registry, launcher, launchers, js, EventPublisher(js, registry))
    endpoints = Endpoints(nc, control, replica)
    service = await endpoints.start()
    log.info("trainer %s up: launcher %s, jobs in %s, registry %s", replica, launcher.name,
             control.jobs_dir, engine.url.render_as_string(hide_password=True))

    # Invariant: every job the registry holds as QUEUED or TRAINING has a run that the launcher
    # knows, or gets one (resumed from its last checkpoint) on the next pass. Every complete line
    # of its events.jsonl is published on events.jobs.<hash>.<kind> once, in file order, through
    # its last event (completed, failed, cancelled); a finished job whose last event is not
    # published yet (events_done false) is picked up again until it is.
    while not stopping.is_set():
        try:
            jobs = await asyncio.to_thread(registry.to_reconcile)
            states = await run_states(control, jobs)
            for job in jobs:
                if stopping.is_set():
                    break
                try:
                    async with control.lock(job.job_hash):
                        await reconcile_job(control, job.job_hash, states)
                except bus.BusUnavailable as exc:
                    log.warning("job %s: events not published yet: %s", job.job_hash, exc)
                except Exception:  # noqa: BLE001 - one broken job must not stop the others
                    log.exception("job %s: reconcile failed", job.job_hash)
        except Exception:  # noqa: BLE001 - the database or a launcher is down: try again next time
            log.exception("reconcile pass failed")
        try:
            await asyncio.wait_for(stopping.wait(), timeout=settings.reconcile_interval_s)
        except asyncio.TimeoutError:
            pass

    log.info("trainer stopping")
    await service.stop()
    await endpoints.drain(SHUTDOWN_GRACE_S)
    try:
        await nc.drain()
    except Exception as exc:  # noqa: BLE001 - already closed by a failed reconnect
        log.debug("drain: %s", exc)
    engine.dispose()
    log.info("trainer stopped")
    return 0
