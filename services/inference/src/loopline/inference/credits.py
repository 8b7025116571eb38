"""Work pulled from JetStream on standing credit rather than by one pull request per wake-up.

The replica keeps pull requests for all of its free capacity waiting at the server, and JetStream
pushes each work item into one the moment it is stored: nothing from the replica in between. When
work finishes, one new pull request asks for everything freed since the last. Per work item that
saves the pull request and the reply that ends it (``fetch(1)`` and then ``fetch(n)`` did both), a
socket write and a wake-up on each side, which on a small machine come out of the core a burst of
requests is being read, tokenized and added to the engine on.

``outstanding`` is how many messages the server may still send: each message uses one, and a 408
(the pull expired) or a 409 (e.g. "Server Shutdown" from a NATS stopping cleanly) hands back the
rest it names in ``Nats-Pending-Messages``. Pull requests vanish without a word when the connection
drops or NATS crashes; a reconnect, or silence for longer than a pull lives, sets the count back to
zero so that the capacity is asked for again. Should the server still hold a pull after all (a
dropped connection, a server that lived on), up to twice the capacity may come for a few seconds:
the engine queues the extra, nothing is lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

log = logging.getLogger(__name__)

# A pull expires after this, and its unused credit is asked for again. Only a bound on how long a
# lost pull goes unnoticed; while one waits it costs the server nothing.
EXPIRES_S = 5.0
# Silence past a pull's lifetime by this much means the server no longer holds it.
GRACE_S = 2.0


class CreditPull:
    """Delivers the messages of one durable pull consumer to ``on_message``, never more at once
    than ``capacity()`` allowed when they were asked for."""

    def __init__(self, nc: NATS, stream: str, durable: str, *, capacity: Callable[[], int],
                 on_message: Callable[[Msg], None], api_prefix: str = "$JS.API",
                 expires_s: float = EXPIRES_S):
        self.nc = nc
        self.next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.capacity, self.on_message = capacity, on_message
        self.expires_s = expires_s
        self.inbox = nc.new_inbox()
        self.outstanding = 0
        self.changed = asyncio.Event()  # capacity freed or credit returned: ask again
        self._heard_at = self._asked_at = time.monotonic()
        self._reconnects = 0
        self._sub = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._reconnects = self.nc.stats["reconnects"]
        self._sub = await self.nc.subscribe(self.inbox, cb=self._on_msg)
        self.changed.set()  # the first ask, at once
        self._task = asyncio.create_task(self._ask_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection closing
                pass

    async def _on_msg(self, msg: Msg) -> None:
        self._heard_at = time.monotonic()
        status = msg.headers.get("Status") if msg.headers else None
        if status is None:
            self.outstanding = max(0, self.outstanding - 1)
            self.on_message(msg)
            return
        if status == "100":  # heartbeat or flow control: neither is asked for, nothing to do
            return
        unused = msg.headers.get("Nats-Pending-Messages")
        if unused is not None and unused.isdigit():
            # 408: expired; 409: ended early (e.g. the consumer's limits): the rest comes back.
            self.outstanding = max(0, self.outstanding - int(unused))
        else:
            log.warning("pull ended with %s %s; asking again for all free capacity",
                        status, msg.headers.get("Description", ""))
            self.outstanding = 0
        self.changed.set()

    async def _ask_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
            self.changed.clear()
            self._check_lost()
            want = self.capacity() - self.outstanding
            if want <= 0 or not self.nc.is_connected:
                continue
            request = {"batch": want, "expires": int(self.expires_s * 1e9)}
            try:
                await self.nc.publish(self.next_subject, json.dumps(request).encode(), reply=self.inbox)
            except Exception as exc:  # noqa: BLE001 - NATS restarting: ask again next round
                log.warning("pull request failed (%s); retrying", exc)
                continue
            self.outstanding += want
            self._asked_at = time.monotonic()

    def _check_lost(self) -> None:
        """Credit the server cannot still hold: after a reconnect, or when a pull should long have
        ended (with messages or a 408) and nothing came."""
        reconnects = self.nc.stats["reconnects"]
        quiet_since = max(self._heard_at, self._asked_at)
        if reconnects != self._reconnects or (
                self.outstanding and time.monotonic() - quiet_since > self.expires_s + GRACE_S):
            if self.outstanding:
                log.info("%d pulled messages never came (reconnect or lost pull); asking again",
                         self.outstanding)
            self._reconnects = reconnects
            self.outstanding = 0
