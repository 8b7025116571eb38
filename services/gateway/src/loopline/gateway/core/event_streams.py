"""Server-sent events from the EVENTS stream, for every route that follows events there: a training
job's (scalarlm/train_streams_api.py) and the Tinker session workers' (tinker/events_api.py).

One SSE message per stored event, ``id`` its stream sequence (a client that lost its connection
asks again from there), ``event`` its kind, ``data`` the event's JSON without its empty fields.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from pydantic import ValidationError

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# A comment line this often keeps proxies from closing a quiet event stream.
KEEPALIVE_S = 15.0
# A subject already over when the stream opens (a finished job, a released worker): its stored
# history is all there is; this much silence means it has all been sent (covers a history whose
# final event has aged out of the stream).
HISTORY_IDLE_S = 1.0


class Event(Protocol):
    """What an EVENTS message is read into: one of the wire schemas with a ``kind``."""

    @property
    def kind(self) -> str: ...

    def model_dump_json(self, *, exclude_none: bool = False) -> str: ...


E = TypeVar("E", bound=Event)


def _always(_event: object) -> bool:
    return True


def _never(_event: object) -> bool:
    return False


async def sse(sub: JetStreamContext.PushSubscription, parse: Callable[[bytes], E], *, over: bool,
              keep: Callable[[E], bool | Awaitable[bool]] = _always,
              ends: Callable[[E], bool] = _never) -> AsyncIterator[str]:
    """The events ``sub`` delivers, as SSE text: those ``keep`` accepts are sent; the stream ends
    after an event ``ends`` says is the last, or (``over``: nothing more will come) once the stored
    history has been sent. A stream that neither ends nor is over runs until the client leaves.
    ``keep`` may be a coroutine function (it may ask who owns the event's job: auth/tenancy.py).
    ``parse`` is the schema's ``model_validate_json``; a message it refuses is skipped."""
    # Invariant: stored events are read once each, in stream order, and each one kept is sent once.
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=HISTORY_IDLE_S if over else KEEPALIVE_S)
            except NatsTimeoutError:
                if over:
                    return
                yield ": keepalive\n\n"
                continue
            try:
                event = parse(msg.data)
            except ValidationError as exc:
                log.warning("skipping a malformed event on %s: %s", msg.subject, exc)
                continue
            kept = keep(event)
            if kept if isinstance(kept, bool) else await kept:
                data = event.model_dump_json(exclude_none=True)
                yield f"id: {msg.metadata.sequence.stream}\nevent: {event.kind}\ndata: {data}\n\n"
            if ends(event) or (over and msg.metadata.num_pending == 0):
                return
    finally:
        await sub.unsubscribe()
