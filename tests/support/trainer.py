"""A client for the trainer's API and events in tests: what the gateway does, in a few lines."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import nats.errors
from nats.js.api import DeliverPolicy
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER
from pydantic import BaseModel

from loopline.common import subjects
from loopline.common.job_schemas import JobEvent, JobInfo, JobRef

DATASET = b'{"input": "What is 2+2?", "output": " 4"}\n{"input": "Capital of France?", "output": " Paris"}\n'


class Refused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class TrainerClient:
    """What the gateway does, in a few lines: datasets into the object store, svc.trainer.*
    requests, and an ordered consumer on a job's events."""

    def __init__(self, nc):
        self.nc = nc
        self.js = nc.jetstream()

    async def call(self, subject: str, body: BaseModel | dict | None = None, timeout_s: float = 30.0) -> dict:
        if isinstance(body, BaseModel):
            payload = body.model_dump_json().encode()
        else:
            payload = json.dumps(body or {}).encode()
        msg = await self.nc.request(subject, payload, timeout=timeout_s)
        headers = msg.headers or {}
        if headers.get(ERROR_CODE_HEADER):
            raise Refused(headers[ERROR_CODE_HEADER], headers.get(ERROR_HEADER, ""))
        return json.loads(msg.data)

    async def put(self, content: bytes) -> str:
        sha = hashlib.sha256(content).hexdigest()
        store = await self.js.object_store(subjects.DATASETS_BUCKET)
        await store.put(sha, content)
        return sha

    async def submit(self, params: dict, dataset: bytes = DATASET, code: bytes | None = None) -> JobInfo:
        dataset_sha = await self.put(dataset)
        code_sha = await self.put(code) if code is not None else None
        whole = json.dumps({"params": params, "dataset": dataset_sha, "code": code_sha}, sort_keys=True)
        # A JobSubmit's fields as a plain dict: params go as given, so that the trainer's own
        # refusal of a bad one is what a test sees (JobSubmit would refuse it here).
        request = {"job_hash": hashlib.sha256(whole.encode()).hexdigest(), "params": params,
                   "dataset_sha256": dataset_sha, "dataset_bytes": len(dataset),
                   "examples": dataset.count(b"\n"), "code_sha256": code_sha}
        return JobInfo.model_validate(await self.call(subjects.SVC_TRAINER_SUBMIT, request))

    async def job(self, subject: str, ref: str) -> JobInfo:
        return JobInfo.model_validate(await self.call(subject, JobRef(job=ref)))

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
