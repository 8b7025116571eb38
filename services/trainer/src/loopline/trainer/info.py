"""A job as the gateway sees it (JobInfo): its row, plus the loss history and checkpoints read
from its directory (they are not kept in SQL).

One reply carries one page of a job's history (LOOPLINE_MAX_HISTORY_POINTS at most, so it stays
well under NATS's max_payload whatever the job wrote); a list carries each job's newest few points
only, enough for its smoothed loss (LIST_HISTORY_POINTS).
"""

from __future__ import annotations

from typing import Any

from loopline.common.contracts.job_layout import CODE_DIR
from loopline.common.contracts.job_schemas import CheckpointInfo, HistoryPoint, JobInfo
from loopline.trainer import jobdir
from loopline.trainer.errors import InvalidRequest
from loopline.trainer.registry import Job

# ScalarLM's list shows an exponential moving average (0.9) of the loss: over the last 100 points it
# is the average over them all to within 0.9**100 (3e-5) of the first point's weight.
LIST_HISTORY_POINTS = 100
LIST_CHECKPOINTS = 1


def job_info(job: Job, limits: jobdir.ReadLimits = jobdir.DEFAULT_LIMITS, *,
             history_offset: int | None = None, history_limit: int | None = None,
             checkpoints: int | None = None) -> JobInfo:
    """Blocking (reads files): call through asyncio.to_thread. The history page from point
    ``history_offset`` (the newest points when None), ``history_limit`` points (a page's most when
    None; more is refused); the newest ``checkpoints`` (a page's most when None)."""
    cap = limits.max_history_points
    if history_limit is not None and history_limit > cap:
        raise InvalidRequest(f"history_limit={history_limit} is more points than one reply carries; the "
                             f"limit is {cap} (`LOOPLINE_MAX_HISTORY_POINTS`)")
    try:
        status = jobdir.read_status(job.job_dir, limits.max_status_bytes) or {}
    except jobdir.OverLimit:
        status = {}  # the reconcile loop fails the job with why; its row still answers
    points = _points(status.get("history"))
    limit = cap if history_limit is None else history_limit
    start = max(0, len(points) - limit) if history_offset is None else min(history_offset, len(points))
    newest = cap if checkpoints is None else checkpoints
    return JobInfo(
        job_hash=job.job_hash,
        status=job.status,
        params=job.params,
        llm_name=job.llm_name,
        adapter_type=job.adapter_type,
        job_directory=str(job.job_dir),
        dataset_sha256=job.dataset_sha256,
        code_sha256=job.code_sha256,
        code_origin=_code_origin(job),
        slurm_job_id=job.slurm_job_id,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        step=_int(status.get("step"), job.step),
        max_steps=_int(status.get("max_steps"), job.max_steps) or job.max_steps,
        history=_history(points[start:start + limit]),
        history_offset=start,
        history_total=len(points),
        checkpoints=[CheckpointInfo(step=step, path=path, created_at=mtime)
                     for step, path, mtime in jobdir.checkpoints(job.job_dir, newest)],
        error=job.error,
        owner=job.owner,
        hub=job.hub,
    )


def _code_origin(job: Job) -> str | None:
    """What ml/ code the job runs when it shipped one: its own (unpacked in its directory) or the
    installed one (the shipped ml/ was Loopline's own, so it was not unpacked)."""
    if job.code_sha256 is None:
        return None
    return "shipped" if (job.job_dir / CODE_DIR).is_dir() else "installed"


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def list_info(job: Job, limits: jobdir.ReadLimits = jobdir.DEFAULT_LIMITS) -> JobInfo:
    """A job as a list shows it: its newest points and checkpoint only."""
    return job_info(job, limits, history_limit=min(LIST_HISTORY_POINTS, limits.max_history_points),
                    checkpoints=LIST_CHECKPOINTS)


def _points(points: Any) -> list[dict]:
    """The history's points as written, those that can be points of the curve: a skipped
    (non-finite) step is written without a loss."""
    if not isinstance(points, list):
        return []
    return [p for p in points if isinstance(p, dict) and isinstance(p.get("step"), int)
            and isinstance(p.get("loss"), (int, float))]


def _history(points: list[dict]) -> list[HistoryPoint]:
    history = []
    for point in points:
        try:
            history.append(HistoryPoint.model_validate(point))
        except ValueError:
            continue
    return history
