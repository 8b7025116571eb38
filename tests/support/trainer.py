"""The trainer's API and events for tests, through the product's own parts: requests and refusals by
loopline.common.runtime.service_client (the client the gateway wraps), datasets read as the gateway reads
them (training_archive), job hashes as the gateway makes them (job_hash over canonical params)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import time
from collections.abc import Mapping
from typing import Any

import nats.errors
from nats.js.api import DeliverPolicy
from pydantic import BaseModel, ValidationError

from loopline.common.contracts import subjects
from loopline.common.contracts.job_hash import job_hash
from loopline.common.contracts.job_schemas import JobEvent, JobInfo, JobRef
from loopline.common.contracts.train_params import TrainParams, canonical
from loopline.common.contracts.training_archive import read_training_archive
from loopline.common.runtime.service_client import ServiceClient

DATASET = b'{"input": "What is 2+2?", "output": " 4"}\n{"input": "Capital of France?", "output": " Paris"}\n'


def submit_hash(params: Mapping[str, Any], dataset_sha256: str, code_sha256: str | None) -> str:
    """The job hash the gateway gives these params (train_submit.py): over their canonical form.
    Params TrainParams refuses have none (the gateway stops them first); a test that sends them to
    the trainer anyway names the job by the same function over the params as given."""
    try:
        hashed = canonical(TrainParams.model_validate(params))
    except ValidationError:
        hashed = dict(params)
    return job_hash(hashed, dataset_sha256, code_sha256)


class TrainerClient:
    """Datasets into the object store, svc.trainer.* requests, and an ordered consumer on a job's
    events, as the gateway does them."""

    def __init__(self, nc, timeout_s: float = 30.0):
        self.nc = nc
        self.js = nc.jetstream()
        self.service = ServiceClient(nc, "trainer", timeout_s)

    async def call(self, subject: str, body: BaseModel | Mapping[str, Any] | None = None) -> Any:
        """The answer as plain JSON (a test may send what the wire types would refuse)."""
        return json.loads(await self.service.request(subject, body))

    async def put(self, content: bytes) -> str:
        sha = hashlib.sha256(content).hexdigest()
        store = await self.js.object_store(subjects.DATASETS_BUCKET)
        await store.put(sha, content)
        return sha

    async def submit(self, params: dict, dataset: bytes = DATASET, code: bytes | None = None,
                     **submit: Any) -> JobInfo:
        """``submit``: more JobSubmit fields (``admin=True``, as the gateway sends for an admin key)."""
        # Named, sized and counted as the gateway does it for a plain jsonlines upload.
        with read_training_archive(io.BytesIO(dataset), len(dataset), max_members=1) as read:
            dataset_sha, dataset_bytes, examples = read.dataset_sha256, read.dataset_bytes, read.examples
        assert await self.put(dataset) == dataset_sha
        code_sha = await self.put(code) if code is not None else None
        # A JobSubmit's fields as a plain dict: params go as given, so that the trainer's own
        # refusal of a bad one is what a test sees (JobSubmit would refuse it here).
        request = {"job_hash": submit_hash(params, dataset_sha, code_sha), "params": params,
                   "dataset_sha256": dataset_sha, "dataset_bytes": dataset_bytes, "examples": examples,
                   "code_sha256": code_sha, **submit}
        return await self.service.call(subjects.SVC_TRAINER_SUBMIT, request, JobInfo)

    async def job(self, subject: str, ref: str) -> JobInfo:
        return await self.service.call(subject, JobRef(job=ref), JobInfo)

    async def get(self, ref: str) -> JobInfo:
        return await self.job(subjects.SVC_TRAINER_GET, ref)

    async def wait_status(self, ref: str, *statuses: str, timeout_s: float = 60.0) -> JobInfo:
        deadline = time.monotonic() + timeout_s
        while True:
            info = await self.get(ref)
            if info.status.value in statuses:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {ref} still {info.status.value} (want {statuses}): {info}")
            await asyncio.sleep(0.1)

    async def events(self, job_hash: str, until: str | None = None,
                     timeout_s: float = 60.0) -> list[JobEvent]:
        """The job's events from the first stored one, as a late subscriber sees them: with
        ``until``, up to the first event of that kind (waiting for it), else all stored now."""
        if until is None:
            info = await self.js.stream_info(subjects.EVENTS_STREAM,
                                             subjects_filter=subjects.job_events(job_hash))
            stored = sum((info.state.subjects or {}).values())
        sub = await self.js.subscribe(subjects.job_events(job_hash), stream=subjects.EVENTS_STREAM,
                                      ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
        events: list[JobEvent] = []
        deadline = time.monotonic() + timeout_s
        try:
            # Invariant: `events` are the job's first len(events) events, in stream order.
            while until is not None or len(events) < stored:
                try:
                    msg = await sub.next_msg(timeout=max(0.05, deadline - time.monotonic()))
                except nats.errors.TimeoutError:
                    kinds = [e.kind for e in events]
                    raise AssertionError(f"no {until or 'more'!r} events for {job_hash} within "
                                         f"{timeout_s}s: {kinds}") from None
                events.append(JobEvent.model_validate_json(msg.data))
                if until and events[-1].kind == until:
                    break
            return events
        finally:
            await sub.unsubscribe()
