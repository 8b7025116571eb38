"""The trainer's request-reply endpoints (nats.micro) on svc.trainer.*, beside the runtime's status.

Requests and replies are the wire types of loopline.common.contracts.job_schemas. A refused request is
answered with nats.micro's error headers, the HTTP status the gateway should use as the code.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from nats.micro.request import Request
from nats.micro.service import Service
from pydantic import BaseModel, ValidationError

from loopline.common.contracts import subjects
from loopline.common.contracts.job_schemas import (
    ClusterInfo,
    JobInfo,
    JobList,
    JobListRequest,
    JobRef,
    JobSubmit,
    LogLine,
    LogLines,
    LogsRequest,
    SqueueReply,
)
from loopline.common.contracts.tinker_schemas import PlaceModel, TinkerWorkerList
from loopline.trainer import jobdir
from loopline.trainer.control import JobControl
from loopline.trainer.errors import InvalidRequest, TrainerError, Unavailable
from loopline.trainer.info import job_info, list_info
from loopline.trainer.launchers import LauncherError
from loopline.trainer.registry import Job
from loopline.trainer.tinker_workers import SessionWorkers

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[BaseModel]]


class Endpoints:
    def __init__(self, control: JobControl, tinker: SessionWorkers):
        self.control = control
        self.tinker = tinker
        # nats.micro handles one endpoint's requests one after another; a submit that downloads a
        # dataset or a delete that waits for a run to stop must not hold up the others. Each
        # request runs as its own task (the per-job locks order those about one job).
        self._tasks: set[asyncio.Task] = set()

    async def add_to(self, service: Service) -> None:
        routes: dict[str, tuple[str, Handler]] = {
            "submit": (subjects.SVC_TRAINER_SUBMIT, self.submit),
            "get": (subjects.SVC_TRAINER_GET, self.get),
            "list": (subjects.SVC_TRAINER_LIST, self.list),
            "cancel": (subjects.SVC_TRAINER_CANCEL, self.cancel),
            "delete": (subjects.SVC_TRAINER_DELETE, self.delete),
            "restart": (subjects.SVC_TRAINER_RESTART, self.restart),
            "logs": (subjects.SVC_TRAINER_LOGS, self.logs),
            "squeue": (subjects.SVC_TRAINER_SQUEUE, self.squeue),
            "cluster": (subjects.SVC_TRAINER_CLUSTER, self.cluster),
            "tinker-place": (subjects.SVC_TRAINER_TINKER_PLACE, self.tinker_place),
            "tinker-workers": (subjects.SVC_TRAINER_TINKER_WORKERS, self.tinker_workers),
        }
        for name, (subject, handler) in routes.items():
            await service.add_endpoint(name=name, subject=subject, handler=self._concurrent(name, handler))

    def _concurrent(self, name: str, handler: Handler) -> Callable[[Request], Awaitable[None]]:
        answer = _answering(name, handler)

        async def spawn(req: Request) -> None:
            task = asyncio.create_task(answer(req), name=f"trainer-{name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return spawn

    async def drain(self, timeout_s: float) -> None:
        """Let requests in progress finish (a submit between sbatch and its row update)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    def _info(self, job: Job, ref: JobRef | None = None) -> Awaitable[JobInfo]:
        """The job's reply: one page of its history (``ref``'s, or its newest points)."""
        offset, limit = (None, None) if ref is None else (ref.history_offset, ref.history_limit)
        return asyncio.to_thread(job_info, job, self.control.limits, history_offset=offset,
                                 history_limit=limit)

    async def submit(self, req: Request) -> BaseModel:
        job = await self.control.submit(_parse(req, JobSubmit))
        return await self._info(job)

    async def get(self, req: Request) -> BaseModel:
        ref = _parse(req, JobRef)
        job = await self.control.find(ref.job, ref.owner)
        return await self._info(job, ref)

    async def list(self, req: Request) -> BaseModel:
        owner = _parse(req, JobListRequest).owner
        jobs = await asyncio.to_thread(self.control.registry.list, owner)
        limits = self.control.limits
        return JobList(jobs=await asyncio.to_thread(lambda: [list_info(job, limits) for job in jobs]))

    async def cancel(self, req: Request) -> BaseModel:
        job = await self.control.cancel(_parse(req, JobRef).job)
        return await self._info(job)

    async def delete(self, req: Request) -> BaseModel:
        job = await self.control.delete(_parse(req, JobRef).job)
        return await self._info(job)

    async def restart(self, req: Request) -> BaseModel:
        job = await self.control.restart(_parse(req, JobRef).job)
        return await self._info(job)

    async def logs(self, req: Request) -> BaseModel:
        request = _parse(req, LogsRequest)
        if request.starting_line_number < 0 or request.limit < 0:
            raise InvalidRequest("starting_line_number and limit must not be negative")
        job = await self.control.find(request.job, request.owner)
        lines, more = await asyncio.to_thread(log_page, job, request, self.control.limits)
        return LogLines(job_hash=job.job_hash, lines=lines, finished=job.status.finished, more=more)

    async def squeue(self, req: Request) -> BaseModel:
        owner = _parse(req, JobListRequest).owner
        try:
            # A tenant sees its own jobs' rows only (gateway auth/tenancy.py); None: every row.
            jobs = None if owner is None else [job.job_hash for job in
                                               await asyncio.to_thread(self.control.registry.list, owner)]
            text = await asyncio.to_thread(self.control.launcher.queue_text, jobs)
        except LauncherError as exc:
            return SqueueReply(squeue_output="", error_message=str(exc))
        return SqueueReply(squeue_output=text)

    async def cluster(self, req: Request) -> BaseModel:
        launcher = self.control.launcher
        try:
            gpus, nodes = await asyncio.to_thread(launcher.cluster_info)
        except LauncherError as exc:
            raise Unavailable(str(exc)) from exc
        return ClusterInfo(gpu_count=gpus, node_count=nodes, launcher=launcher.name)

    async def tinker_place(self, req: Request) -> BaseModel:
        return await self.tinker.place(_parse(req, PlaceModel))

    async def tinker_workers(self, req: Request) -> BaseModel:
        return TinkerWorkerList(workers=await self.tinker.store.workers())

    async def status_detail(self) -> dict[str, Any]:
        """What svc.trainer.status reports beside the replica: the launcher and the jobs by status."""
        counts = await asyncio.to_thread(self.control.registry.counts)
        return {"launcher": self.control.launcher.name, "jobs_dir": str(self.control.jobs_dir),
                "jobs": counts}


def log_page(job: Job, request: LogsRequest, limits: jobdir.ReadLimits) -> tuple[list[LogLine], bool]:
    """The request's lines, as many as fit LOOPLINE_MAX_LOG_PAGE_BYTES (as JSON; the first always
    does: a line is at most LOOPLINE_MAX_LOG_LINE_BYTES of the log), and whether more are there."""
    lines: list[LogLine] = []
    size = 0
    found = jobdir.log_lines(job.job_dir, request.starting_line_number, request.limit + 1,
                             limits.max_log_line_bytes)
    for number, text in found:
        line = LogLine(line_number=number, line=text)
        size += len(line.model_dump_json()) + 1
        if len(lines) == request.limit or (lines and size > limits.max_log_page_bytes):
            return lines, True
        lines.append(line)
    return lines, False


def _parse(req: Request, model: type[BaseModel]):
    try:
        return model.model_validate_json(req.data or b"{}")
    except ValidationError as exc:
        raise InvalidRequest(f"bad {model.__name__}: {exc}") from exc


def _answering(name: str, handler: Handler) -> Callable[[Request], Coroutine[Any, Any, None]]:
    """Send the handler's reply, or its refusal as a nats.micro error with the HTTP status."""

    async def answer(req: Request) -> None:
        try:
            reply = await handler(req)
        except TrainerError as exc:
            await req.respond_error(exc.code, exc.message)
            return
        except Exception as exc:  # the caller gets a 500 instead of a timeout
            log.exception("%s failed", name)
            await req.respond_error("500", f"{name} failed: {type(exc).__name__}: {exc}")
            return
        await req.respond(reply.model_dump_json().encode())

    return answer
