"""Where this gateway hears the results of the requests it holds connections for.

One core subscription, ``answers.<gateway>.*``, for all of them: work items name
``answers.<gateway>.<group>`` as their ``reply_to`` and the replica publishes each result there as
well as to RESULTS. A subscription per request cost a SUB and an UNSUB (each a socket write here and
an interest-graph change in nats-server) and a task in nats-py, for every request.

Core messages are lost while NATS reconnects; the waiters look such results up in RESULTS.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ResultItem

log = logging.getLogger(__name__)


class Answers:
    def __init__(self, nc: NATS):
        self.nc = nc
        # Unique per gateway process: a restarted gateway must not hear its predecessor's answers.
        self.gateway = uuid.uuid4().hex[:16]
        self._waiting: dict[str, Callable[[ResultItem], None]] = {}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(subjects.gateway_answers(self.gateway), cb=self._on_msg)

    def expect(self, group: str, on_result: Callable[[ResultItem], None]) -> str:
        """Deliver ``group``'s results to ``on_result`` from now on; returns the ``reply_to`` for
        its work items. Call before publishing them, so that no answer arrives unheard."""
        self._waiting[group] = on_result
        return subjects.answer(self.gateway, group)

    def forget(self, group: str) -> None:
        self._waiting.pop(group, None)

    async def _on_msg(self, msg: Msg) -> None:
        on_result = self._waiting.get(msg.subject.rpartition(".")[2])
        if on_result is None:  # answered already, or the client went away
            return
        try:
            result = ResultItem.model_validate_json(msg.data)
        except ValueError:
            log.error("dropping a malformed answer on %s", msg.subject)
            return
        on_result(result)
