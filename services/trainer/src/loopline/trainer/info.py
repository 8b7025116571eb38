"""A job as the gateway sees it (JobInfo): its row, plus the loss history and checkpoints read
from its directory (they are not kept in SQL)."""

from __future__ import annotations

from typing import Any

from loopline.common.contracts.job_layout import CODE_DIR
from loopline.common.contracts.job_schemas import CheckpointInfo, HistoryPoint, JobInfo
from loopline.trainer import jobdir
from loopline.trainer.registry import Job


def job_info(job: Job) -> JobInfo:
    """Blocking (reads files): call through asyncio.to_thread."""
    status = jobdir.read_status(job.job_dir) or {}
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
        history=_history(status.get("history")),
        checkpoints=[CheckpointInfo(step=step, path=path, created_at=mtime)
                     for step, path, mtime in jobdir.checkpoints(job.job_dir)],
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


def _history(points: Any) -> list[HistoryPoint]:
    history = []
    for point in points if isinstance(points, list) else []:
        # A skipped (non-finite) step is written without a loss: not a point of the curve.
        if isinstance(point, dict) and isinstance(point.get("loss"), (int, float)):
            try:
                history.append(HistoryPoint.model_validate(point))
            except ValueError:
                continue
    return history
