"""Finding a request's results: stored ones in RESULTS, and those that arrive while a client waits.

Replicas store every result in RESULTS under ``results.<group>.<index>``, so any gateway can answer
for any request; they also publish it on core NATS, which is how a waiting gateway hears it at once.
Core messages are lost while NATS reconnects: waiters look what they may have missed up in the store
(arrivals.py). (OpenAI requests hear their results through answers.py instead; they use the look-ups
below.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ResultItem, parse_stream_event
from loopline.gateway.core.arrivals import Arrivals

log = logging.getLogger(__name__)


class Results:
    def __init__(self, nc: NATS, js: JetStreamContext):
        self.nc = nc
        self.js = js

    async def lookup(self, group: str, index: int) -> ResultItem | None:
        """The stored result of one request, or None (not done yet, expired, or NATS restarting)."""
        try:
            raw = await self.js.get_last_msg(subjects.RESULTS_STREAM, subjects.result(group, index),
                                             direct=True)
        except NotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - NATS restarting: the caller asks again later
            log.debug("lookup of %s.%d failed: %s", group, index, exc)
            return None
        return ResultItem.model_validate_json(raw.data or b"")

    async def waiter(self, group: str) -> ResultWaiter:
        """A waiter for ``group``'s results, already listening; close it when done."""
        waiter = ResultWaiter(self, group)
        await waiter.open()
        return waiter

    async def follow_stream(self, request_id: str,
                            on_event: Callable[[tuple[int, bytes]], None]) -> Subscription:
        """Hand each event of a streamed answer to ``on_event`` as ``(position, bytes)``;
        unsubscribe when done. Events are core messages, lost in a reconnect: the request's result
        holds the whole transcript and is the authority."""
        async def on_msg(msg: Msg) -> None:
            on_event(parse_stream_event(msg.data))

        return await self.nc.subscribe(subjects.token_stream(request_id), cb=on_msg)


class ResultWaiter:
    """Collects a group's results: those already stored and those that arrive while we wait."""

    def __init__(self, results: Results, group: str):
        self.results = results
        self.group = group
        self.arrivals: Arrivals[int, ResultItem] = Arrivals(lambda index: results.lookup(group, index))
        self._sub: Subscription | None = None

    async def open(self) -> None:
        self._sub = await self.results.nc.subscribe(subjects.results_of_group(self.group), cb=self._on_msg)

    async def _on_msg(self, msg: Msg) -> None:
        result = ResultItem.model_validate_json(msg.data)
        self.arrivals.heard(result.index, result)

    async def wait(self, indices: list[int], timeout_s: float, *,
                   stored_first: bool) -> dict[int, ResultItem]:
        """Return the results of ``indices`` available within ``timeout_s``."""
        return await self.arrivals.wait(indices, timeout_s, stored_first=stored_first)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
