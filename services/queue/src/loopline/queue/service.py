"""The queue service process: migrate the ledger, connect, answer svc.queue.*, run the loops.

Loops, each its own task under the shared runtime (loopline.common.runtime.service):
  ledger-work     WORK    -> requests rows 'queued'         (ledger_loop.py)
  ledger-results  RESULTS -> requests rows completed/failed  (ledger_loop.py)
  deployments     MODELS bucket -> the set of deployments    (deployments.py)
  admission       consumer info -> queue.state               (admission.py)
  dead-letters    max-deliveries advisories -> 503 results   (dead_letters.py)
A queue service without its ledger or admission state must not limp on: a loop that dies ends the
process (the runtime's policy), and its supervisor starts a new one.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from loopline.common.config.settings import QueueSettings
from loopline.common.contracts import subjects
from loopline.common.db.engine import migrate, open_database
from loopline.common.runtime import metrics
from loopline.common.runtime.service import Runtime
from loopline.queue.admission import Admission
from loopline.queue.dead_letters import DeadLetters
from loopline.queue.deployments import DeploymentDirectory
from loopline.queue.endpoints import Endpoints
from loopline.queue.ledger_loop import RESULTS_FEED, WORK_FEED, run_feed
from loopline.queue.state_metrics import state_families


async def run(rt: Runtime, settings: QueueSettings) -> None:
    # 1. The ledger is a record, off every request's path: run on the CPU the others leave.
    if settings.nice:
        os.nice(settings.nice)

    # 2. Migrate before anything reads or writes; alembic is synchronous, so off the event loop.
    db = open_database(settings.resolved_database_url())
    rt.on_stop(db.dispose)
    await asyncio.to_thread(migrate, db)

    # 3. Connect, and build the parts.
    nc, js = await rt.connect()
    directory = DeploymentDirectory(js)
    admission = Admission(nc, js, directory, max_depth=settings.max_queue_depth,
                          interval_s=settings.state_interval_s)
    endpoints = Endpoints(js, db, admission)
    # /metrics reads the admission state last published (the ledger counts its rows itself).
    rt.on_stop(metrics.register(metrics.StateCollector(lambda: admission.latest, state_families)))

    # 4. Answer svc.queue.* (every replica in one queue group: each request is answered once).
    service = await rt.add_service(
        subjects.QUEUE_SERVICE, subjects.SVC_QUEUE_STATUS, status=endpoints.status_detail,
        description="Loopline request ledger, admission state, dead letters and queue metrics",
        metadata={"ledger": db.url.render_as_string(hide_password=True)})
    await endpoints.add_to(service)

    # 5. Run the loops until told to stop; each finishes the step it is in, so written rows get acked.
    stop = rt.stopping
    feed: dict[str, Any] = {"batch": settings.ledger_batch, "linger_s": settings.ledger_linger_s}
    await rt.serve({
        "ledger-work": run_feed(WORK_FEED, js, db, stopping=stop, **feed),
        "ledger-results": run_feed(RESULTS_FEED, js, db, stopping=stop, **feed),
        "deployments": directory.run(stop),
        "admission": admission.run(stop),
        "dead-letters": DeadLetters(nc, js, db).run(stop),
    })
