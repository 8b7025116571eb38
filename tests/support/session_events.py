"""The session workers' events stored on the EVENTS stream, read from synchronous tests."""

from __future__ import annotations

import asyncio

from loopline.common.contracts import subjects
from loopline.common.contracts.tinker_schemas import SessionEvent
from loopline.common.runtime import bus


def session_events(nats_url: str, model_id: str | None = None) -> list[SessionEvent]:
    """Every stored session event (one training run's, given its model id), oldest first."""
    async def read() -> list[SessionEvent]:
        nc = await bus.connect(nats_url, "test-session-events")
        try:
            sub = await nc.jetstream().subscribe(subjects.SESSION_EVENTS_ALL, stream=subjects.EVENTS_STREAM,
                                                 ordered_consumer=True)
            events = []
            while True:
                try:
                    msg = await sub.next_msg(timeout=1)
                except TimeoutError:
                    return events
                events.append(SessionEvent.model_validate_json(msg.data))
        finally:
            await nc.close()

    return [e for e in asyncio.run(read()) if model_id is None or e.model_id == model_id]
