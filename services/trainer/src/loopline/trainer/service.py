"""The trainer service process: migrate the registry, connect, answer svc.trainer.* requests, and
reconcile the unfinished jobs every ``reconcile_interval_s`` until told to stop.

Loops, under the shared runtime (loopline.common.runtime.service):
  reconcile       registry x job directories x launcher -> rows, runs, job events  (reconcile.py)
  tinker-workers  session workers x launcher -> released or failed, their calls answered
                  (tinker_workers.py)
  hub             COMPLETED jobs with push_to_hub -> pushed to the Hugging Face Hub, hub events
                  (hub_loop.py)
and the nats.micro endpoints (endpoints.py) answer on svc.trainer.*, each request its own task.

Its state is the SQL registry and the job directories; nothing lives only in memory, so it can be
stopped at any moment and started again (the reconcile loop picks up where the last one stopped).
Run it as one replica: two would both resubmit a job whose run ended.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from loopline.common.config.settings import TrainerSettings
from loopline.common.contracts import subjects
from loopline.common.db.engine import migrate, open_database
from loopline.common.runtime import metrics
from loopline.common.runtime.service import Runtime
from loopline.trainer import jobdir
from loopline.trainer.control import JobControl
from loopline.trainer.endpoints import Endpoints
from loopline.trainer.events import EventPublisher
from loopline.trainer.hub_loop import hub_loop
from loopline.trainer.hub_push import HubPusher
from loopline.trainer.hub_repos import HubRepos
from loopline.trainer.launchers import make_launchers
from loopline.trainer.reconcile import reconcile_loop
from loopline.trainer.registry import Registry, job_count_families
from loopline.trainer.tinker_workers import SessionWorkers, tinker_workers_loop

log = logging.getLogger(__name__)


async def run(rt: Runtime, settings: TrainerSettings) -> None:
    # 1. Migrate the registry before anything reads it; alembic is synchronous, so off the loop.
    db = open_database(settings.resolved_database_url())
    rt.on_stop(db.dispose)
    await asyncio.to_thread(migrate, db)

    # 2. The jobs directory, without the staging folders of submits a crash interrupted.
    settings.jobs_dir.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(jobdir.clean_staging, settings.jobs_dir)

    # 3. Connect, and build the parts.
    nc, js = await rt.connect()
    launcher, launchers = make_launchers(settings.launcher, settings.jobs_dir.resolve(),
                                         partition=settings.slurm_partition,
                                         extra_args=settings.slurm_extra_args,
                                         job_env_allow=settings.job_env_allow)
    registry = Registry(db)
    publisher = EventPublisher(js, registry, jobdir.ReadLimits.of(settings))
    control = JobControl(settings, registry, launcher, launchers, js, publisher)
    # Tinker session workers: started through the same launcher as jobs, followed like them.
    tinker = SessionWorkers(settings, launcher, launchers, nc, js)
    await tinker.start()
    endpoints = Endpoints(control, tinker)
    # /metrics counts the registry's jobs by status when scraped (on the scrape's thread).
    rt.on_stop(metrics.register(metrics.StateCollector(registry.counts, job_count_families)))

    # 4. Answer svc.trainer.*; at the stop, requests in progress get to finish (a submit between
    # sbatch and its row update) before NATS drains.
    service = await rt.add_service(
        subjects.TRAINER_SERVICE, subjects.SVC_TRAINER_STATUS, status=endpoints.status_detail,
        description="Loopline trainer: training job registry, Slurm submission, job events",
        metadata={"launcher": launcher.name, "registry": db.url.render_as_string(hide_password=True)})
    await endpoints.add_to(service)
    rt.on_stop(functools.partial(endpoints.drain, rt.grace_s))
    log.info("trainer: launcher %s, jobs in %s", launcher.name, control.jobs_dir)

    # 5. Reconcile until told to stop.
    interval = settings.reconcile_interval_s
    await rt.serve({"reconcile": reconcile_loop(control, rt.stopping, interval),
                    "tinker-workers": tinker_workers_loop(tinker, rt.stopping, interval),
                    "hub": hub_loop(control, HubPusher(settings, HubRepos(db)), rt.stopping, interval)})
