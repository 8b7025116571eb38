"""The trainer's reconcile loop, and its step: bring each unfinished job's row, events and run in
line with its job directory and its launcher (and finish publishing for a job the trainer ended
just before a crash).

For one job, under its lock:
  1. publish the new lines of events.jsonl;
  2. copy progress from status.json into the row (QUEUED -> TRAINING, step, loss);
  3. no run recorded (crash after sbatch, or sbatch refused): adopt a live one or launch again;
  4. run still alive or its state unknown: nothing more to do this time;
  5. run ended: publish its last lines, then status.json decides: COMPLETED/FAILED finish the
     job (a COMPLETED one with push_to_hub is then due to be pushed: hub_loop.py); anything
     else means it was killed (preempted, time limit, node failure, scancel behind our back)
     and it is launched again to resume from its last checkpoint.
The row is only marked finished after the run ended and its last lines were published, so a job's
``completed`` event can never be left behind. A job whose status.json or an events.jsonl line is
larger than the trainer reads (jobdir.OverLimit) is failed with that reason, its run stopped: the
trainer never reads more than the limit of it, and goes on with the other jobs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from loopline.common.contracts.job_schemas import JobStatus
from loopline.common.runtime import bus
from loopline.common.runtime.service import pause
from loopline.trainer import jobdir
from loopline.trainer.control import JobControl
from loopline.trainer.hub_loop import hub_pending
from loopline.trainer.launchers import LauncherError, LaunchState
from loopline.trainer.registry import Job

log = logging.getLogger(__name__)

RunStates = dict[tuple[str, str], LaunchState]


async def reconcile_loop(control: JobControl, stopping: asyncio.Event, interval_s: float) -> None:
    """Reconcile every unfinished job every ``interval_s`` until ``stopping``; a job in progress is
    finished first."""
    # Invariant: every job the registry holds as QUEUED or TRAINING has a run that the launcher
    # knows, or gets one (resumed from its last checkpoint) on the next pass. Every complete line
    # of its events.jsonl is published on events.jobs.<hash>.<kind> once, in file order, through
    # its last event (completed, failed, cancelled); a finished job whose last event is not
    # published yet (events_done false) is picked up again until it is. A pass that fails (the
    # database or a launcher down) is tried again at the next one.
    while not stopping.is_set():
        try:
            jobs = await asyncio.to_thread(control.registry.to_reconcile)
            states = await run_states(control, jobs)
            for job in jobs:
                if stopping.is_set():
                    break
                try:
                    async with control.lock(job.job_hash):
                        await reconcile_job(control, job.job_hash, states)
                except bus.BusUnavailable as exc:
                    log.warning("job %s: events not published yet: %s", job.job_hash, exc)
                except Exception:  # one broken job must not stop the others
                    log.exception("job %s: reconcile failed", job.job_hash)
        except Exception:  # the database or a launcher is down: try again next time
            log.exception("reconcile pass failed")
        await pause(stopping, interval_s)


async def run_states(control: JobControl, jobs: list[Job]) -> RunStates:
    """The state of every job's run, one query per launcher. A launcher that cannot answer leaves
    its runs out: unknown, so nothing is decided about them."""
    ids: dict[str, list[str]] = {}
    for job in jobs:
        if job.slurm_job_id is not None and not job.status.finished:
            ids.setdefault(job.launcher, []).append(job.slurm_job_id)
    states: RunStates = {}
    for name, run_ids in ids.items():
        launcher = control.launchers.get(name)
        if launcher is None:
            log.warning("jobs launched by %r, which this trainer does not have, are not followed", name)
            continue
        try:
            found = await asyncio.to_thread(launcher.states, run_ids)
        except LauncherError as exc:
            log.warning("%s did not answer: %s", name, exc)
            continue
        states.update({(name, run_id): state for run_id, state in found.items()})
    return states


async def reconcile_job(control: JobControl, job_hash: str, states: RunStates) -> None:
    """Steps 1-5 above for one job; call with the job's lock held."""
    job = await asyncio.to_thread(control.registry.get, job_hash)
    if job is None:
        return  # deleted since the states were read
    if job.status.finished:
        if not job.events_done:
            # Ended by the trainer (cancel, given up), which died before publishing that.
            await control.publisher.publish_final(job)
        return
    try:
        await _follow(control, job, states)
    except jobdir.OverLimit as exc:
        log.warning("job %s: failed: %s", job_hash, exc)
        fresh = await asyncio.to_thread(control.registry.get, job_hash)
        if fresh is not None:
            await control.fail_running(fresh, f"the job wrote more than the trainer reads: {exc}")


async def _follow(control: JobControl, job: Job, states: RunStates) -> None:
    job = await control.publisher.publish_pending(job)
    job = await _copy_progress(control, job)

    if job.slurm_job_id is None:
        await _launch_missing(control, job)
        return
    state = states.get((job.launcher, job.slurm_job_id), LaunchState.UNKNOWN)
    if not state.ended:
        return

    # Nothing writes the directory any more: what is there now is all the run left.
    job = await control.publisher.publish_pending(job)
    job = await _copy_progress(control, job)
    status = await asyncio.to_thread(jobdir.read_status, job.job_dir, control.limits.max_status_bytes) or {}
    ending = status.get("status")
    if ending == JobStatus.COMPLETED.value:
        log.info("job %s completed", job.job_hash)
        # Its push to the Hub, when asked for, is due from the same update on (hub_loop.py).
        await asyncio.to_thread(control.registry.update, job, status=JobStatus.COMPLETED, events_done=True,
                                finished_at=status.get("updated_at") or time.time(), error=None,
                                **hub_pending(job))
    elif ending == JobStatus.FAILED.value:
        error = status.get("error") or f"the training program failed (see the {job.launcher} log)"
        log.info("job %s failed: %s", job.job_hash, error)
        await asyncio.to_thread(control.registry.update, job, status=JobStatus.FAILED, events_done=True,
                                finished_at=status.get("updated_at") or time.time(), error=str(error))
    else:
        await control.relaunch(job, f"{job.launcher} run {job.slurm_job_id} ended ({state.value}) "
                                    f"before the job finished")


async def _copy_progress(control: JobControl, job: Job) -> Job:
    status = await asyncio.to_thread(jobdir.read_status, job.job_dir, control.limits.max_status_bytes)
    if not status:
        return job
    changes: dict[str, Any] = {}
    if job.status is JobStatus.QUEUED and status.get("status") in ("TRAINING", "COMPLETED", "FAILED"):
        changes["status"] = JobStatus.TRAINING
        changes["started_at"] = job.started_at or status.get("started_at") or time.time()
    for field in ("step", "max_steps"):
        value = status.get(field)
        if isinstance(value, int) and value != getattr(job, field):
            changes[field] = value
    loss = status.get("loss")
    if isinstance(loss, (int, float)) and loss != job.loss:
        changes["loss"] = float(loss)
    if not changes:
        return job
    return await asyncio.to_thread(control.registry.update, job, **changes)


async def _launch_missing(control: JobControl, job: Job) -> None:
    """The job has no run on record. If the trainer died between sbatch and recording the id, the
    run exists under the job's name: adopt it rather than start a second one."""
    launcher = control.launchers.get(job.launcher) or control.launcher
    try:
        found = await asyncio.to_thread(launcher.find, job.job_hash)
    except LauncherError as exc:
        log.warning("job %s: cannot look for its run: %s", job.job_hash, exc)
        return
    if found is not None:
        log.info("job %s: adopting %s run %s", job.job_hash, launcher.name, found)
        await asyncio.to_thread(control.registry.update, job, launcher=launcher.name, slurm_job_id=found,
                                attempts=job.attempts + 1, submitted_at=time.time(), step_at_submit=job.step)
        return
    if job.attempts == 0 and job.error is None:
        await control.launch(job)  # staged, never submitted: not a retry
    else:
        await control.relaunch(job, job.error or "its run was never recorded")
