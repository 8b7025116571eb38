"""Publishing work: a request's work items onto WORK, and a batch's manifest into BATCHES.

A request is accepted once JetStream has acked its work items; from then on its answer lives in
RESULTS, where any gateway can find it (results.py). A manifest marks a ScalarLM batch as known, so
that an identical resubmission, through any gateway, finds its answers instead of queueing again.
"""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import BatchManifest, WorkItem
from loopline.common.runtime import bus
from loopline.gateway.core.errors import ApiError


class WorkPublisher:
    def __init__(self, js: JetStreamContext, retry_after_s: int):
        self.js = js
        self.retry_after_s = retry_after_s  # what a 429 tells the client to wait
        self.batches: KeyValue | None = None  # BATCHES, opened by start()

    async def start(self) -> None:
        self.batches = await self.js.key_value(subjects.BATCHES_BUCKET)

    async def manifest(self, group: str) -> BatchManifest | None:
        """The batch's manifest if the batch was accepted (all its work stored), else None."""
        assert self.batches is not None, "start() first"
        try:
            entry = await self.batches.get(group)
        except Exception:  # noqa: BLE001 - KeyNotFoundError and friends
            return None
        return BatchManifest.model_validate_json(entry.value) if entry.value else None

    async def publish(self, manifest: BatchManifest | None, items: list[WorkItem], deployment: str) -> None:
        """Make the batch durable on the deployment's (its key's) work subject: every item, each
        awaited until acked, then the manifest — a batch is "known" (and a resubmission skipped)
        only once all of its work is stored."""
        def publish_one(item: WorkItem):
            return bus.publish_durable(self.js, subjects.work(deployment), item.model_dump_json().encode(),
                                       msg_id=item.request_id, deadline_s=30)

        try:
            if len(items) == 1:
                # The common case (one chat or completion) skips gather's task: one event-loop turn
                # less before the work item is on its way.
                await publish_one(items[0])
            else:
                await asyncio.gather(*(publish_one(item) for item in items))
            if manifest is not None:
                assert self.batches is not None, "start() first"
                await self.batches.put(manifest.group, manifest.model_dump_json().encode())
        except bus.StreamFull as exc:
            raise ApiError(429, f"the work queue is full: {exc}; retry later",
                           headers={"Retry-After": str(self.retry_after_s)}) from exc
        except bus.BusUnavailable as exc:
            raise ApiError(503, f"the message bus did not accept the request: {exc}; retry",
                           headers={"Retry-After": "1"}) from exc
