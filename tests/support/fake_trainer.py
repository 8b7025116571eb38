"""A stand-in for the trainer's request-reply API (svc.trainer.*) for testing the gateway alone.

It is a real nats.micro service answering from the wire schemas in loopline.common.job_schemas, with
errors in nats.micro's error headers as the real trainer sends them. It records every submit and the
dataset it found in the object store, publishes job events as the trainer would, and runs on its own
event loop in a thread, so synchronous tests (the scalarlm client is synchronous) can use it.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from dataclasses import dataclass

from nats.micro import add_service
from nats.micro.request import Request
from pydantic import BaseModel

from loopline.common import bus, subjects
from loopline.common.job_schemas import (
    ClusterInfo,
    JobEvent,
    JobInfo,
    JobList,
    JobRef,
    JobStatus,
    JobSubmit,
    LogLine,
    LogLines,
    LogsRequest,
    SqueueReply,
)


@dataclass
class Received:
    submit: JobSubmit
    dataset: bytes
    code: bytes | None


class FakeTrainer:
    def __init__(self, nats_url: str):
        self.nats_url = nats_url
        self.jobs: dict[str, JobInfo] = {}
        self.logs: dict[str, list[str]] = {}
        self.submits: list[Received] = []
        self._seq: dict[str, int] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle (from the test's thread) ------------------------------------------------------------
    def start(self) -> "FakeTrainer":
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.run(self._start())
        return self

    def stop(self) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def run(self, coro, timeout: float = 30):
        """Run a coroutine on the trainer's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        self.nc = await bus.connect(self.nats_url, "fake-trainer")
        self.js = self.nc.jetstream()
        await bus.ensure_topology(self.js)
        self.datasets = await self.js.object_store(subjects.DATASETS_BUCKET)
        await self.start_service()

    async def start_service(self) -> None:
        """Answer svc.trainer.* (again, after a test stopped ``self.service`` to play a trainer outage)."""
        self.service = await add_service(self.nc, name=subjects.TRAINER_SERVICE, version="0.0.0",
                                         description="test stand-in")
        for subject, handler in {
            subjects.SVC_TRAINER_SUBMIT: self._submit, subjects.SVC_TRAINER_GET: self._get,
            subjects.SVC_TRAINER_LIST: self._list, subjects.SVC_TRAINER_CANCEL: self._cancel,
            subjects.SVC_TRAINER_DELETE: self._delete, subjects.SVC_TRAINER_RESTART: self._restart,
            subjects.SVC_TRAINER_LOGS: self._logs, subjects.SVC_TRAINER_SQUEUE: self._squeue,
            subjects.SVC_TRAINER_CLUSTER: self._cluster,
        }.items():
            await self.service.add_endpoint(name=subject.rsplit(".", 1)[1], subject=subject,
                                            handler=self._answering(handler))

    async def _stop(self) -> None:
        await self.service.stop()
        await self.nc.close()

    # --- helpers for tests ---------------------------------------------------------------------------
    def emit(self, job_hash: str, kind: str, **fields) -> None:
        """Publish a job event and move the job's status as the trainer would."""
        self.run(self._emit(job_hash, kind, **fields))

    def dataset_info(self, name: str):
        return self.run(self.datasets.get_info(name))

    async def _emit(self, job_hash: str, kind: str, **fields) -> None:
        status = {"queued": JobStatus.QUEUED, "started": JobStatus.TRAINING, "completed": JobStatus.COMPLETED,
                  "failed": JobStatus.FAILED, "cancelled": JobStatus.CANCELLED}.get(kind)
        job = self.jobs.get(job_hash)
        if job is not None and status is not None:
            job.status = status
        if job is not None and "step" in fields:
            job.step = fields["step"]
        seq = self._seq[job_hash] = self._seq.get(job_hash, 0) + 1
        event = JobEvent(job_hash=job_hash, kind=kind, seq=seq, status=status, **fields)
        await bus.publish_durable(self.js, subjects.job_event(job_hash, kind),
                                  event.model_dump_json().encode(), msg_id=f"{job_hash}:{seq}")

    # --- endpoints -------------------------------------------------------------------------------------
    class Failure(Exception):
        def __init__(self, status: int, message: str):
            super().__init__(message)
            self.status = status

    def _answering(self, handler):
        async def endpoint(req: Request) -> None:
            try:
                reply: BaseModel = await handler(req)
            except FakeTrainer.Failure as exc:
                await req.respond_error(str(exc.status), str(exc))
                return
            await req.respond(reply.model_dump_json().encode())
        return endpoint

    def _find(self, ref: str) -> JobInfo:
        if ref == "latest" and self.jobs:
            return max(self.jobs.values(), key=lambda j: j.created_at)
        matches = [j for h, j in self.jobs.items() if h.startswith(ref)]
        if len(matches) != 1:
            raise FakeTrainer.Failure(404, f"no training job {ref!r}")
        return matches[0]

    async def _submit(self, req: Request) -> JobInfo:
        job = JobSubmit.model_validate_json(req.data)
        dataset = (await self.datasets.get(job.dataset_sha256)).data
        if hashlib.sha256(dataset).hexdigest() != job.dataset_sha256:
            raise FakeTrainer.Failure(422, "the stored dataset does not match its name")
        code = (await self.datasets.get(job.code_sha256)).data if job.code_sha256 else None
        self.submits.append(Received(job, dataset, code))
        if job.job_hash not in self.jobs:
            self.jobs[job.job_hash] = JobInfo(
                job_hash=job.job_hash, status=JobStatus.QUEUED, params=job.params,
                llm_name=job.params.llm_name, adapter_type=job.params.adapter_type,
                job_directory=f"/jobs/{job.job_hash}", slurm_job_id=str(len(self.jobs) + 1),
                created_at=time.time(), max_steps=job.params.max_steps,
                dataset_sha256=job.dataset_sha256, code_sha256=job.code_sha256)
            await self._emit(job.job_hash, "queued")
        return self.jobs[job.job_hash]

    async def _get(self, req: Request) -> JobInfo:
        return self._find(JobRef.model_validate_json(req.data).job)

    async def _list(self, req: Request) -> JobList:
        return JobList(jobs=sorted(self.jobs.values(), key=lambda j: -j.created_at))

    async def _cancel(self, req: Request) -> JobInfo:
        job = self._find(JobRef.model_validate_json(req.data).job)
        if not job.status.finished:
            await self._emit(job.job_hash, "cancelled")
        return job

    async def _delete(self, req: Request) -> JobInfo:
        job = self._find(JobRef.model_validate_json(req.data).job)
        return self.jobs.pop(job.job_hash)

    async def _restart(self, req: Request) -> JobInfo:
        job = self._find(JobRef.model_validate_json(req.data).job)
        if job.status not in (JobStatus.FAILED, JobStatus.CANCELLED):
            raise FakeTrainer.Failure(409, f"job {job.job_hash} is {job.status.value}; only a FAILED or "
                                           "CANCELLED job can be restarted")
        await self._emit(job.job_hash, "queued")
        return job

    async def _logs(self, req: Request) -> LogLines:
        ask = LogsRequest.model_validate_json(req.data)
        job = self._find(ask.job)
        lines = self.logs.get(job.job_hash, [])
        page = [LogLine(line=text, line_number=n) for n, text in enumerate(lines)
                if n >= ask.starting_line_number][: ask.limit]
        return LogLines(job_hash=job.job_hash, lines=page, finished=job.status.finished)

    async def _squeue(self, req: Request) -> SqueueReply:
        return SqueueReply(squeue_output="JOBID PARTITION NAME USER ST TIME NODES\n")

    async def _cluster(self, req: Request) -> ClusterInfo:
        return ClusterInfo(gpu_count=0, node_count=1, launcher="local")
