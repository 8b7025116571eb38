"""The queue service process: migrate the ledger, connect, run the loops, answer requests, stop
cleanly on SIGTERM.

Loops, each its own task:
  ledger work     WORK    -> requests rows 'queued'         (ledger_loop.py)
  ledger results  RESULTS -> requests rows completed/failed  (ledger_loop.py)
  deployments     MODELS bucket -> the set of deployments    (deployments.py)
  admission       consumer info -> queue.state               (admission.py)
  dead letters    max-deliveries advisories -> 503 results   (dead_letters.py)
and the nats.micro endpoints (endpoints.py) answer on svc.queue.*.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket

from loopline.common import bus
from loopline.common.db.engine import make_engine, migrate
from loopline.common.settings import QueueSettings
from loopline.common.telemetry import setup_tracing
from loopline.queue.admission import Admission
from loopline.queue.dead_letters import DeadLetters
from loopline.queue.deployments import DeploymentDirectory
from loopline.queue.endpoints import Endpoints
from loopline.queue.ledger_loop import RESULTS_FEED, WORK_FEED, run_feed

log = logging.getLogger(__name__)

# A loop gets this long after SIGTERM to finish the step it is in (a fetch waits at most 1 s).
SHUTDOWN_GRACE_S = 10.0


async def run(settings: QueueSettings) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit status."""
    replica = f"{socket.gethostname()}-{os.getpid()}"
    setup_tracing("loopline-queue", settings.otlp_endpoint)

    # Migrate before anything reads or writes; alembic is synchronous, so off the event loop.
    engine = make_engine(settings.resolved_database_url())
    await asyncio.to_thread(migrate, engine)

    nc = await bus.connect(settings.nats_url, name=f"queue-{replica}")
    js = nc.jetstream()
    await bus.ensure_topology(js)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    directory = DeploymentDirectory(js)
    admission = Admission(
        nc, js, directory, max_depth=settings.max_queue_depth, interval_s=settings.state_interval_s
    )
    loops = {
        "ledger-work": run_feed(WORK_FEED, js, engine, batch=settings.ledger_batch,
                                linger_s=settings.ledger_linger_s, stopping=stopping),
        "ledger-results": run_feed(RESULTS_FEED, js, engine, batch=settings.ledger_batch,
                                   linger_s=settings.ledger_linger_s, stopping=stopping),
        "deployments": directory.run(stopping),
        "admission": admission.run(stopping),
        "dead-letters": DeadLetters(nc, js, engine).run(stopping),
    }
    tasks = [asyncio.create_task(coro, name=name) for name, coro in loops.items()]
    service = await Endpoints(nc, js, engine, admission, replica).start()
    log.info("queue service %s up (ledger %s)", replica, engine.url.render_as_string(hide_password=True))

    # Every loop runs until ``stopping``; one that ends before that has crashed, and a queue
    # service without its ledger or admission state should exit and be restarted, not limp on.
    stop_wait = asyncio.create_task(stopping.wait())
    done, _ = await asyncio.wait([stop_wait, *tasks], return_when=asyncio.FIRST_COMPLETED)
    status = 0
    signalled = stopping.is_set()
    for task in done:
        # A loop that returned because of the signal it just saw is not a crash.
        if task is not stop_wait and (task.exception() is not None or not signalled):
            status = 1
            log.error("loop %s ended unexpectedly: %r", task.get_name(), task.exception())
    stopping.set()

    # Stop answering first, let each loop finish the step it is in (so written rows get acked),
    # then drain: pending acks and publishes are flushed before the connection closes.
    log.info("queue service stopping")
    await service.stop()
    _, late = await asyncio.wait(tasks, timeout=SHUTDOWN_GRACE_S)
    for task in late:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    try:
        await nc.drain()
    except Exception as exc:  # noqa: BLE001 - already closed by a failed reconnect
        log.debug("drain: %s", exc)
    engine.dispose()
    log.info("queue service stopped")
    return status
