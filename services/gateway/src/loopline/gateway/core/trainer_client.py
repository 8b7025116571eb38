"""The gateway's one way to ask the trainer: its request-reply API (svc.trainer.*), the ``datasets``
object store, and the job events users follow.

The requests go through loopline.common.runtime.service_client, the one client the tests use too: the
trainer's refusals (nats.micro error headers, an HTTP status as the code) become the same HTTP
status here, no trainer running a 503, a trainer too slow a 504.
"""

from __future__ import annotations

from io import BufferedIOBase
from typing import IO, cast

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import ObjectNotFoundError
from nats.js.object_store import ObjectStore
from pydantic import BaseModel

from loopline.common.contracts import subjects
from loopline.common.contracts.job_schemas import (
    ClusterInfo,
    JobInfo,
    JobList,
    JobListRequest,
    JobRef,
    JobSubmit,
    LogLines,
    LogsRequest,
    OwnerFilter,
    SqueueReply,
)
from loopline.common.runtime.service_client import Reply, ServiceClient, ServiceError
from loopline.gateway.core.errors import ApiError, from_service_error

# A submit has the trainer read the dataset back and call sbatch: give it longer than a query.
SUBMIT_TIMEOUT_FACTOR = 4


class TrainerClient:
    def __init__(self, nc: NATS, js: JetStreamContext, timeout_s: float):
        self.nc = nc
        self.js = js
        self.timeout_s = timeout_s
        self.service = ServiceClient(nc, "trainer", timeout_s)
        self._datasets: ObjectStore | None = None  # opened at the first upload

    # --- request-reply ------------------------------------------------------------------------------
    async def call(self, subject: str, body: BaseModel | None, reply: type[Reply],
                   timeout_s: float | None = None) -> Reply:
        try:
            return await self.service.call(subject, body, reply, timeout_s)
        except ServiceError as exc:
            raise from_service_error(exc) from exc

    async def get(self, job: str, owner: OwnerFilter = None, timeout_s: float | None = None, *,
                  history_offset: int | None = None, history_limit: int | None = None) -> JobInfo:
        """The job ``job`` names among ``owner``'s (auth/tenancy.py): another key's is a 404. Its
        history is one page (JobRef): the newest points unless ``history_offset`` says where."""
        ref = JobRef(job=job, owner=owner, history_offset=history_offset, history_limit=history_limit)
        return await self.call(subjects.SVC_TRAINER_GET, ref, JobInfo, timeout_s)

    async def find(self, job_hash: str, owner: OwnerFilter = None) -> JobInfo | None:
        """The job if the trainer knows it (among ``owner``'s); None when it answers 404."""
        try:
            return await self.get(job_hash, owner)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def submit(self, job: JobSubmit) -> JobInfo:
        return await self.call(subjects.SVC_TRAINER_SUBMIT, job, JobInfo,
                               timeout_s=self.timeout_s * SUBMIT_TIMEOUT_FACTOR)

    async def list(self, owner: OwnerFilter = None) -> JobList:
        return await self.call(subjects.SVC_TRAINER_LIST, JobListRequest(owner=owner), JobList)

    async def control(self, subject: str, job: str) -> JobInfo:
        """cancel, delete or restart."""
        return await self.call(subject, JobRef(job=job), JobInfo)

    async def logs(self, request: LogsRequest) -> LogLines:
        return await self.call(subjects.SVC_TRAINER_LOGS, request, LogLines)

    async def squeue(self, owner: OwnerFilter = None) -> SqueueReply:
        return await self.call(subjects.SVC_TRAINER_SQUEUE, JobListRequest(owner=owner), SqueueReply)

    async def cluster(self) -> ClusterInfo:
        return await self.call(subjects.SVC_TRAINER_CLUSTER, None, ClusterInfo)

    # --- datasets -----------------------------------------------------------------------------------
    async def store_dataset(self, name: str, data: bytes | IO[bytes]) -> bool:
        """Put an object in the ``datasets`` bucket under its content hash, unless it is there already
        (the same bytes uploaded again cost nothing). Returns whether it was written now."""
        try:
            if self._datasets is None:
                self._datasets = await self.js.object_store(subjects.DATASETS_BUCKET)
            store = self._datasets
            try:
                await store.get_info(name)
                return False
            except ObjectNotFoundError:
                pass
            # nats-py reads any file with readinto (a spooled temp file too); its hint says BufferedIOBase.
            await store.put(name, cast("bytes | BufferedIOBase", data))
            return True
        except Exception as exc:  # NATS down or JetStream refusing (storage full)
            raise ApiError(503, f"could not store the dataset: {exc}; retry",
                           headers={"Retry-After": "2"}) from exc

    # --- events -------------------------------------------------------------------------------------
    async def follow_events(self, subject_filter: str, *, from_seq: int | None = None,
                            new_only: bool = False):
        """An ordered, ephemeral consumer on EVENTS from the first stored event (or from stream
        sequence ``from_seq``, or, ``new_only``, from the next one published): a client that comes
        late still sees the whole history, then what happens next. Unsubscribe when done."""
        start = None if from_seq is None else ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=from_seq)
        policy = DeliverPolicy.NEW if new_only else DeliverPolicy.ALL
        try:
            return await self.js.subscribe(subject_filter, stream=subjects.EVENTS_STREAM,
                                           ordered_consumer=True, config=start,
                                           deliver_policy=policy if start is None else None)
        except Exception as exc:  # NATS down
            raise ApiError(503, f"cannot follow events: {exc}; retry") from exc

    async def current_run_start(self, job_hash: str) -> int | None:
        """Where the job's current run begins in EVENTS: the stream sequence of its last ``queued``
        event (a restart writes a new one); None when there is none to find (aged out, NATS busy)."""
        try:
            msg = await self.js.get_last_msg(subjects.EVENTS_STREAM, subjects.job_event(job_hash, "queued"))
        except Exception:  # noqa: BLE001 - not found, or NATS busy: follow the whole history instead
            return None
        return msg.seq
