"""Server-sent events from the EVENTS stream, for every route that follows events there: a training
job's (scalarlm/train_streams_api.py) and the Tinker session workers' (tinker/events_api.py).

Each open stream holds a NATS consumer and a task for as long as its client stays: one key (or,
without keys, one client address) may hold ``LOOPLINE_MAX_STREAMS_PER_KEY`` of them at once
(``StreamSlots``, taken by the routes marked ``@held_stream``); one more is refused with 429. A
browser page of another origin is refused (403) before it takes one.

One SSE message per stored event, ``id`` its stream sequence (a client that lost its connection
asks again from there), ``event`` its kind, ``data`` the event's JSON without its empty fields.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from loopline.gateway.auth.same_origin import SETTING as ALLOWED_ORIGINS, foreign_page
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.limits import holder_of, over_limit

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
E_co = TypeVar("E_co", bound=Event, covariant=True)


def _always(_event: object) -> bool:
    return True


def _never(_event: object) -> bool:
    return False


def _no_wait(_event: object) -> None:
    return None


class Schema(Protocol[E_co]):
    def model_validate_json(self, json_data: bytes) -> E_co: ...


def of(schema: Schema[E]) -> Callable[[Msg], E]:
    """``sse``'s ``parse`` for a subject whose messages are all one schema."""
    return lambda msg: schema.model_validate_json(msg.data)


async def sse(sub: JetStreamContext.PushSubscription, parse: Callable[[Msg], E], *, over: bool,
              keep: Callable[[E], bool | Awaitable[bool]] = _always,
              ends: Callable[[E], bool] = _never,
              then_awaits: Callable[[E], Callable[[E], bool] | None] = _no_wait,
              linger_s: float = 0.0) -> AsyncIterator[str]:
    """The events ``sub`` delivers, as SSE text: those ``keep`` accepts are sent; the stream ends
    after an event ``ends`` says is the last, or (``over``: nothing more will come) once the stored
    history has been sent. A stream that neither ends nor is over runs until the client leaves.
    ``keep`` may be a coroutine function (it may ask who owns the event's job: auth/tenancy.py).
    ``then_awaits``, given the event that ended the stream, may name an event still to come (a
    finished job's deployment): the stream then goes on until that one is sent or ``linger_s`` have
    passed; when ``over``, until the stored history has been sent. ``parse`` reads a message
    (``of(Schema)``); a message it refuses is skipped."""
    awaited: Callable[[E], bool] | None = None
    satisfied = False
    deadline = 0.0
    # Invariant: stored events are read once each, in stream order, and each one kept is sent once;
    # awaited is set only once an event has ended the stream (deadline with it), satisfied once an
    # event it awaited has been read.
    try:
        while True:
            lingering = awaited is not None and not satisfied
            wait = HISTORY_IDLE_S if over else KEEPALIVE_S
            if lingering:
                wait = min(KEEPALIVE_S, deadline - time.monotonic())
                if wait <= 0:
                    return
            try:
                msg = await sub.next_msg(timeout=wait)
            except NatsTimeoutError:
                if lingering:
                    continue
                if over:
                    return
                yield ": keepalive\n\n"
                continue
            try:
                event = parse(msg)
            except ValidationError as exc:
                log.warning("skipping a malformed event on %s: %s", msg.subject, exc)
                continue
            kept = keep(event)
            if kept if isinstance(kept, bool) else await kept:
                data = event.model_dump_json(exclude_none=True)
                yield f"id: {msg.metadata.sequence.stream}\nevent: {event.kind}\ndata: {data}\n\n"
            if awaited is None and ends(event):
                awaited = then_awaits(event)
                if awaited is None and not over:
                    return
                deadline = time.monotonic() + linger_s
            elif lingering and awaited is not None and awaited(event):
                satisfied = True
                if not over:
                    return
            # A stored history is sent whole, and then what it still awaits, if anything.
            if over and msg.metadata.num_pending == 0 and (awaited is None or satisfied):
                return
    finally:
        await sub.unsubscribe()


class StreamSlots:
    """How many streams each holder (an API key, or a client address without keys) has open."""

    def __init__(self, limit: int):
        self.limit = limit
        self.open: dict[str, int] = {}

    def take(self, request: Request) -> Callable[[], None]:
        """One slot of the request's holder, or a 429; returns what gives it back (once, however
        often it is called)."""
        holder = holder_of(request)
        held = self.open.get(holder, 0)
        if held >= self.limit:
            raise over_limit(429, f"{holder} holds {held} open event streams; close one first", self.limit,
                             "max_streams_per_key")
        self.open[holder] = held + 1
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                left = self.open[holder] - 1
                if left:
                    self.open[holder] = left
                else:
                    del self.open[holder]

        return give_back


class _HeldStream(StreamingResponse):
    """A stream that gives its slot back when it ends, however it ends (finished, the client gone,
    cancelled before its first event: a generator's own ``finally`` would not run then)."""

    def __init__(self, response: StreamingResponse, give_back: Callable[[], None]):
        super().__init__(response.body_iterator, status_code=response.status_code,
                         media_type=response.media_type)
        self.raw_headers = response.raw_headers
        self.give_back = give_back

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.give_back()


Route = TypeVar("Route", bound=Callable[..., Awaitable[Any]])


def held_stream(route: Route) -> Route:
    """Mark a streaming route (one with a ``request`` parameter): each call takes a slot of its
    caller's before any work (a 429 when none is free), held until the stream ends."""

    @functools.wraps(route)
    async def taking_a_slot(*args: Any, **kwargs: Any) -> Any:
        request: Request = kwargs["request"]
        gateway = request.app.state.gateway
        # A GET passes SameOrigin: without this, any page its user visits could hold all of the
        # user's slots (one client address under `make up`) and lock out their own dashboard.
        why = foreign_page(request.scope, gateway.settings.allowed_origin_set)
        if why is not None:
            raise ApiError(403, f"event stream refused: {why}. Only the gateway's own pages and those "
                                f"of {ALLOWED_ORIGINS} may open event streams from a browser",
                           type="permission_error")
        give_back = gateway.streams.take(request)
        try:
            response = await route(*args, **kwargs)
        except BaseException:
            give_back()
            raise
        if not isinstance(response, StreamingResponse):
            give_back()
            return response
        return _HeldStream(response, give_back)

    return taking_a_slot  # type: ignore[return-value]
