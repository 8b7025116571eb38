"""What can be done to a job: submit, cancel, delete, restart, and (for the reconcile loop) launch
again or fail it. Endpoints and the reconcile loop both go through here.

Every change to one job happens under that job's lock, so a cancel never races a resubmit and a
restart never races the reconcile step that would mark the job finished.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError, ObjectNotFoundError

from loopline.common.config.settings import TrainerSettings
from loopline.common.contracts import job_env, subjects
from loopline.common.contracts.job_layout import CODE_DIR, DATASET_FILE
from loopline.common.contracts.job_schemas import JobStatus, JobSubmit, OwnerFilter
from loopline.common.contracts.train_params import JobConfig, TrainParams
from loopline.common.runtime import adapter_retire, bus, objects
from loopline.trainer import hub_push, jobdir, shipped_code
from loopline.trainer.errors import CodeRefused, InvalidRequest, TrainerError, Unavailable, WrongState
from loopline.trainer.events import EventPublisher
from loopline.trainer.launchers import Launcher, LauncherError, LaunchSpec, LaunchState
from loopline.trainer.models import resolve_model_path
from loopline.trainer.registry import Job, Registry

log = logging.getLogger(__name__)

# How long a cancel/delete/restart waits for a run it stopped to end (its SIGTERM checkpoint).
STOP_WAIT_S = 20.0


class JobControl:
    def __init__(self, settings: TrainerSettings, registry: Registry, launcher: Launcher,
                 launchers: dict[str, Launcher], js: JetStreamContext, publisher: EventPublisher):
        self.settings = settings
        self.registry = registry
        self.launcher = launcher
        self.launchers = launchers
        self.js = js
        self.publisher = publisher
        self.jobs_dir = Path(settings.jobs_dir).resolve()
        self.limits = jobdir.ReadLimits.of(settings)
        # Whom a job's own ml/ code runs as (a uid per job, where the trainer is root); a bad name ends
        # the trainer at start, not a job later.
        self.job_user = job_env.job_user(settings.job_user, uid_range=settings.job_uid_range)
        if settings.allow_user_code and self.job_user is None:
            # make up as a laptop's own user: their code, their uid. Anywhere shared it is not boxed.
            log.warning("LOOPLINE_ALLOW_USER_CODE is on and a job's own ml/ code runs as this trainer's "
                        "own user (uid %d), with its rights: fine for one user's own machine only; run "
                        "the trainer as root to give each job a uid of its own", os.geteuid())
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def lock(self, job_hash: str) -> asyncio.Lock:
        return self._locks[job_hash]

    async def find(self, ref: str, owner: OwnerFilter = None) -> Job:
        """The job ``ref`` names, among ``owner``'s jobs (job_schemas.OwnerFilter)."""
        return await asyncio.to_thread(self.registry.resolve, ref, owner)

    async def _fresh(self, ref: str) -> Job:
        """The job as it is now (call under its lock): it may have changed while we waited."""
        job = await asyncio.to_thread(self.registry.get, ref)
        if job is None:
            job = await self.find(ref)  # raises the 404
        return job

    # --- submit ---------------------------------------------------------------------------------
    async def submit(self, request: JobSubmit) -> Job:
        """Create, stage and launch the job; an existing hash returns the existing job as it is.
        The request was validated as it was parsed (JobSubmit: the hash formats, TrainParams)."""
        job_hash = request.job_hash
        async with self.lock(job_hash):
            existing = await asyncio.to_thread(self.registry.get, job_hash)
            if existing is not None:
                return existing
            await asyncio.to_thread(self._check_hub_push, request)
            llm_name = request.params.llm_name or self.settings.model
            params = request.params.model_copy(update={"llm_name": llm_name})
            model_path = resolve_model_path(llm_name, self.settings.models_dir)
            job_dir = self.jobs_dir / job_hash
            await self._stage(request, job_dir, model_path, params)
            now = time.time()
            job = Job(
                job_hash=job_hash, status=JobStatus.QUEUED, params=params, llm_name=llm_name,
                model_path=model_path, adapter_type=params.adapter_type, job_dir=job_dir,
                dataset_sha256=request.dataset_sha256, code_sha256=request.code_sha256,
                launcher=self.launcher.name, slurm_job_id=None, attempts=0, retries=0, step_at_submit=0,
                created_at=now, submitted_at=None, started_at=None, finished_at=None, step=0,
                max_steps=params.max_steps, loss=None, error=None,
                events_seq=0, events_offset=0, owner=request.owner,
            )
            job = await asyncio.to_thread(self.registry.insert, job)
            job = await self.launch(job)
            return await self._publish(job)

    async def _stage(self, request: JobSubmit, job_dir: Path, model_path: str, params: TrainParams) -> None:
        staging = await asyncio.to_thread(jobdir.staging_dir, self.jobs_dir, request.job_hash)
        try:
            await self._fetch(request.dataset_sha256, staging / DATASET_FILE, "dataset")
            if request.code_sha256:
                tar = staging / ".code.tar"
                await self._fetch(request.code_sha256, tar, "code archive")
                # Loopline's own ml/ (the client run in a checkout) is not unpacked: the installed
                # code runs, so it is no user code, allowed or not.
                if not await asyncio.to_thread(shipped_code.is_installed_ml, tar):
                    await self._check_user_code()
                    await asyncio.to_thread(jobdir.extract_code, tar, staging, self.settings.max_code_bytes)
                tar.unlink()
            config = JobConfig(job_hash=request.job_hash, model_path=model_path, params=params)
            await asyncio.to_thread(jobdir.write_config, staging, config)
            # The first event is in the job's event log before the job exists: it is published
            # from there like every other, so a crash cannot lose it.
            await asyncio.to_thread(jobdir.append_event, staging, "queued", status=JobStatus.QUEUED.value)
            await asyncio.to_thread(jobdir.install, staging, job_dir)
        except BaseException:
            await asyncio.to_thread(jobdir.remove, staging)
            raise

    def _check_hub_push(self, request: JobSubmit) -> None:
        """Refuse a push_to_hub this trainer could not do (no token) or may not do (the operator's
        settings, hub_push.check_allowed) before training, not after."""
        push = request.params.push_to_hub
        if push is None:
            return
        try:
            hub_push.check_allowed(self.settings, push, request.admin)
        except hub_push.NotAllowed as exc:
            raise InvalidRequest(f"params.push_to_hub.{exc}") from exc
        try:
            token = hub_push.hub_token(self.settings)
        except hub_push.NoToken as exc:
            raise InvalidRequest(f"params.push_to_hub: {exc}") from exc
        if token is None:
            raise InvalidRequest("params.push_to_hub: this server has no Hugging Face token to push with "
                                 "(an operator sets HF_TOKEN or LOOPLINE_HUB_TOKEN_FILE for the trainer)")

    async def _check_user_code(self) -> None:
        """Refuse a job's own code where user code is off, or where the job user could not run it."""
        if not self.settings.allow_user_code:
            raise CodeRefused(
                "this job ships its own ml/ code, which differs from Loopline's installed loopline.ml, "
                "and this server does not run user code (LOOPLINE_ALLOW_USER_CODE=true enables it for "
                "trusted users)")
        if self.job_user is None:
            return
        program = self._program(1)[0]
        program = shutil.which(program) or program
        # As the job user: can it run the program and enter the jobs directory (every folder above
        # them must let it through)? Cheaper to ask now than to fail the job five times later.
        check = [*self.job_user.argv(), "test", "-x", program, "-a", "-x", str(self.jobs_dir)]
        done = await asyncio.to_thread(subprocess.run, check, stdin=subprocess.DEVNULL,
                                       capture_output=True, timeout=10)
        if done.returncode != 0:
            raise CodeRefused(
                f"this server runs a job's own ml/ code as user {self.job_user.name!r}, who cannot run "
                f"{program} or enter {self.jobs_dir}; an operator can set LOOPLINE_JOB_USER to a user "
                f"who can")

    async def _fetch(self, name: str, dest: Path, what: str) -> None:
        try:
            with open(dest, "wb") as f:  # noqa: ASYNC230 - chunks are written from the event loop
                await objects.read_into(self.js, subjects.DATASETS_BUCKET, name, f)
        except (ObjectNotFoundError, NotFoundError) as exc:
            raise InvalidRequest(f"the {what} {name} is not in the {subjects.DATASETS_BUCKET!r} "
                                 f"object store") from exc
        except TrainerError:
            raise
        except Exception as exc:  # NATS down or slow: the gateway may retry
            raise Unavailable(f"could not read the {what} {name}: {type(exc).__name__}: {exc}") from exc

    # --- launching ------------------------------------------------------------------------------
    def _program(self, ranks: int) -> list[str]:
        if self.settings.train_command:
            return shlex.split(self.settings.train_command)
        module = "loopline.ml.parallel" if ranks > 1 else "loopline.ml.train"
        # The trainer's own interpreter: the job runs in the same environment.
        return [sys.executable, "-m", module]

    def train_argv(self, job: Job) -> list[str]:
        return [*self._program(job.ranks), "--job-dir", str(job.job_dir)]

    async def launch(self, job: Job) -> Job:
        """Submit one run of the job (first, resubmitted, or restarted). When the launcher refuses,
        the job keeps no run id and its error says why; the reconcile loop tries again."""
        launcher = self.launcher
        program = self.train_argv(job)
        # Its own code unpacked (user code, allowed at submit): it runs as the job user (a uid of
        # its own), each rank dropping privileges itself, in a directory that user owns.
        user_code = (job.job_dir / CODE_DIR).is_dir()
        run_as = self.job_user if user_code else None
        if run_as is not None:
            run_as = await asyncio.to_thread(jobdir.give_to, job.job_dir, run_as)
            program = [*run_as.argv(), *program]
        argv = launcher.rank_command(job.ranks, program)
        await asyncio.to_thread(jobdir.write_entrypoint, job.job_dir, argv, user_code=user_code,
                                run_as=run_as)
        timeout = job.params.timeout or self.settings.max_train_time_s
        spec = LaunchSpec(job.job_hash, job.job_dir, job.ranks,
                          time_limit_s=int(min(float(timeout), self.settings.max_train_time_s)))
        try:
            run_id = await asyncio.to_thread(launcher.submit, spec)
        except LauncherError as exc:
            log.warning("job %s: %s could not submit: %s", job.job_hash, launcher.name, exc)
            return await asyncio.to_thread(self.registry.update, job, slurm_job_id=None,
                                           launcher=launcher.name, error=f"could not submit: {exc}")
        log.info("job %s: %s run %s (attempt %d)", job.job_hash, launcher.name, run_id, job.attempts + 1)
        return await asyncio.to_thread(
            self.registry.update, job, launcher=launcher.name, slurm_job_id=run_id, attempts=job.attempts + 1,
            submitted_at=time.time(), step_at_submit=job.step, error=None)

    async def relaunch(self, job: Job, why: str) -> Job:
        """The job's run is over but the job is not: submit it again, so it resumes from its last
        checkpoint. Runs that end without progress count; too many in a row fail the job."""
        retries = 0 if job.step > job.step_at_submit else job.retries + 1
        if retries > self.settings.max_resubmits:
            tail = await asyncio.to_thread(jobdir.log_tail, job.job_dir)
            error = f"{why}; it ended {retries} times in a row without progress, so it was not resubmitted"
            return await self.fail(job, error + (f".\nLast output:\n{tail}" if tail else "."))
        log.warning("job %s: %s; resubmitting (%d without progress)", job.job_hash, why, retries)
        job = await asyncio.to_thread(self.registry.update, job, retries=retries)
        return await self.launch(job)

    async def fail_running(self, job: Job, error: str) -> Job:
        """Fail a job whose run may still be going (call under its lock): the run is stopped first,
        so nothing it writes after its ``failed`` event is taken for the job's."""
        await self._stop_run(job)
        return await self.fail(job, error)

    async def fail(self, job: Job, error: str) -> Job:
        job = await asyncio.to_thread(self.registry.update, job, status=JobStatus.FAILED,
                                      finished_at=time.time(), error=error, events_done=False)
        await asyncio.to_thread(jobdir.append_event, job.job_dir, "failed", status=JobStatus.FAILED.value,
                                step=job.step, error=error)
        return await self._publish(job, final=True)

    async def _publish(self, job: Job, final: bool = False) -> Job:
        """Publish the job's new events now (through its last one when ``final``); if NATS is down,
        the reconcile loop does it later: the request has succeeded, its effect is in SQL and the
        job directory."""
        try:
            if final:
                return await self.publisher.publish_final(job)
            return await self.publisher.publish_pending(job)
        except bus.BusUnavailable as exc:
            log.warning("job %s: events not published yet: %s", job.job_hash, exc)
            return job

    # --- cancel, delete, restart ----------------------------------------------------------------
    async def cancel(self, ref: str) -> Job:
        job = await self.find(ref)
        async with self.lock(job.job_hash):
            job = await self._fresh(job.job_hash)
            if job.status is JobStatus.CANCELLED:
                return job
            if job.status.finished:
                raise WrongState(f"job {job.job_hash} is {job.status.value}; only a queued or training "
                                 f"job can be cancelled")
            await self._stop_run(job)
            # Finished first, its event second: a crash in between leaves a finished job whose
            # events are not done, and the reconcile loop writes and publishes the event.
            job = await asyncio.to_thread(self.registry.update, job, status=JobStatus.CANCELLED,
                                          finished_at=time.time(), events_done=False)
            await asyncio.to_thread(jobdir.append_event, job.job_dir, "cancelled",
                                    status=JobStatus.CANCELLED.value, step=job.step)
            return await self._publish(job, final=True)

    async def delete(self, ref: str) -> Job:
        job = await self.find(ref)
        async with self.lock(job.job_hash):
            job = await self._fresh(job.job_hash)
            if not job.status.finished:
                await self._stop_run(job)
                job = await asyncio.to_thread(self.registry.update, job, status=JobStatus.CANCELLED,
                                              finished_at=time.time(), events_done=True)
            # Its run must be over before the directory goes, or a checkpoint written on SIGTERM
            # would bring part of it back.
            await self._wait_stopped(job)
            try:
                # A job submitted again under this hash starts a fresh history for late subscribers.
                await self.js.purge_stream(subjects.EVENTS_STREAM, subject=f"events.jobs.{job.job_hash}.>")
            except Exception as exc:  # noqa: BLE001 - the events age out anyway
                log.warning("job %s: could not purge its events: %s", job.job_hash, exc)
            # The folder before the purge: the checkpoint-watcher, finding it gone after an
            # announcement, withdraws what it announced late (adapter_retire.py).
            await asyncio.to_thread(jobdir.remove, job.job_dir)
            try:
                # Its adapter everywhere: announcements and objects purged, replicas unload it,
                # gateways stop routing it. Before the row goes: a delete that fails here is retried.
                await adapter_retire.retire(self.js, job.job_hash)
            except Exception as exc:
                raise Unavailable(f"could not retire job {job.job_hash}'s adapter: "
                                  f"{type(exc).__name__}: {exc}; delete it again") from exc
            await asyncio.to_thread(self.registry.delete, job.job_hash)
            log.info("job %s deleted", job.job_hash)
            return job

    async def restart(self, ref: str) -> Job:
        job = await self.find(ref)
        async with self.lock(job.job_hash):
            job = await self._fresh(job.job_hash)
            if job.status not in (JobStatus.FAILED, JobStatus.CANCELLED):
                raise WrongState(f"job {job.job_hash} is {job.status.value}; only a failed or cancelled "
                                 f"job can be restarted")
            if not await self._wait_stopped(job):
                raise WrongState(f"job {job.job_hash}'s previous run is still stopping; retry shortly")
            await asyncio.to_thread(jobdir.mark_requeued, job.job_dir, self.limits.max_status_bytes)
            # What the old run wrote after it was cancelled or failed is not news: start after it.
            seq, offset = await asyncio.to_thread(jobdir.events_end, job.job_dir,
                                                  self.limits.max_event_line_bytes)
            job = await asyncio.to_thread(
                self.registry.update, job, status=JobStatus.QUEUED, error=None, finished_at=None, retries=0,
                slurm_job_id=None, events_seq=seq, events_offset=offset, events_done=False)
            await asyncio.to_thread(jobdir.append_event, job.job_dir, "queued", status=JobStatus.QUEUED.value,
                                    step=job.step)
            job = await self.launch(job)
            return await self._publish(job)

    async def _stop_run(self, job: Job) -> None:
        launcher = self.launchers.get(job.launcher)
        if job.slurm_job_id is None or launcher is None:
            return
        try:
            await asyncio.to_thread(launcher.cancel, job.slurm_job_id)
        except LauncherError as exc:
            raise Unavailable(f"could not stop {launcher.name} run {job.slurm_job_id}: {exc}") from exc

    async def _wait_stopped(self, job: Job) -> bool:
        """Wait (a bounded time) until the job's last run has ended; True when it has."""
        launcher = self.launchers.get(job.launcher)
        if job.slurm_job_id is None or launcher is None:
            return True
        deadline = time.monotonic() + STOP_WAIT_S
        while True:
            try:
                state = await asyncio.to_thread(launcher.state, job.slurm_job_id)
            except LauncherError:
                state = LaunchState.UNKNOWN
            if state.ended:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.2)
