"""The newest events on EVENTS (jobs, adapters, Tinker session workers), kept by the gateway for
every open dashboard page: one subscription per gateway, however many pages are open; each page
shows the ones its key may see (ui/visibility.py) and is woken when one arrives (``changed``).

Bounded: the newest ``KEEP`` events; a page shows fewer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from loopline.common.contracts import subjects

log = logging.getLogger(__name__)

KEEP = 200


@dataclass(frozen=True)
class FeedEvent:
    seq: int  # its EVENTS sequence
    subject: str
    area: str  # "jobs", "adapters", "sessions": the subject's second token
    kind: str
    body: dict[str, Any]

    @property
    def job_hash(self) -> str | None:
        return self.body.get("job_hash") if self.area in ("jobs", "adapters") else None

    @property
    def model_id(self) -> str | None:
        return self.body.get("model_id") if self.area == "sessions" else None


class EventFeed:
    def __init__(self, js: JetStreamContext, keep: int = KEEP):
        self.js = js
        self.events: deque[FeedEvent] = deque(maxlen=keep)
        self.version = 0  # one more per event heard
        self._changed = asyncio.Condition()
        self._sub: JetStreamContext.PushSubscription | None = None

    async def start(self) -> None:
        """Follow EVENTS from the newest ``keep`` stored events on. A NATS that is down leaves the
        feed empty, not the gateway unstarted: the pages say there are no events."""
        try:
            info = await self.js.stream_info(subjects.EVENTS_STREAM)
            first = max(info.state.first_seq, info.state.last_seq - (self.events.maxlen or KEEP) + 1, 1)
            self._sub = await self.js.subscribe(
                subjects.EVENTS_ALL, stream=subjects.EVENTS_STREAM, ordered_consumer=True, cb=self._on_event,
                idle_heartbeat=1.0, config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                                          opt_start_seq=first))
        except Exception as exc:  # noqa: BLE001
            log.warning("the dashboard will show no events: cannot follow EVENTS (%s)", exc)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection is closing anyway
                pass

    async def _on_event(self, msg: Msg) -> None:
        try:
            body = json.loads(msg.data)
        except ValueError:
            return
        if not isinstance(body, dict):
            return
        tokens = msg.subject.split(".")
        area = tokens[1] if len(tokens) > 1 else ""
        self.events.append(FeedEvent(msg.metadata.sequence.stream, msg.subject, area,
                                     str(body.get("kind") or tokens[-1]), body))
        self.version += 1
        async with self._changed:
            self._changed.notify_all()

    async def wait_past(self, version: int, timeout_s: float) -> int:
        """Wait until an event newer than ``version`` has arrived or ``timeout_s`` have passed; the
        version then."""
        if self.version == version:
            try:
                async with self._changed:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self.version != version), timeout_s)
            except TimeoutError:
                pass
        return self.version
