"""The dashboard's sign-ins: an opaque random session id in the browser's cookie, and, in the
``UI_SESSIONS`` bucket where every gateway replica finds it, what it stands for.

The cookie once held the API key itself, so whatever read the cookie (a server another user runs on
another port of the same host: browsers send a host's cookies to every port) held the key for every
API route. A session id is good for the dashboard's pages only (api_keys.py looks it up on ``/ui``
paths alone), ends when it is signed out, and ends with its key: each request checks that the key it
signed in with is still one of the gateway's, so revoking or rotating the key ends its sessions
within the keys file's re-read (key_store.RECHECK_S).

A record is looked up by the SHA-256 of the id, so the bucket's contents sign nobody in. It is read
on every dashboard request, not cached: a sign-out holds at once on every replica, for one KV read
(well under a millisecond on a local server) per page or live stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import secrets
import time

from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel, ValidationError

from loopline.common.contracts import subjects
from loopline.common.runtime import bus

# secrets.token_urlsafe(32): 43 characters. Anything else is no session, and costs no KV read.
_SESSION_ID = re.compile(rb"^[A-Za-z0-9_-]{43}$")


class SessionsUnavailable(Exception):
    """NATS did not answer a session lookup: the request cannot be told signed in or not."""


class UiSession(BaseModel):
    key_sha256: str
    created_at: float
    expires_at: float


def new_session_id() -> str:
    return secrets.token_urlsafe(32)  # 256 bits


def _record_name(session_id: bytes) -> str:
    return hashlib.sha256(session_id).hexdigest()


class UiSessions:
    def __init__(self, js: JetStreamContext, max_age_s: float):
        self.js = js
        self.max_age_s = max_age_s
        self._kv: KeyValue | None = None
        self._opening = asyncio.Lock()

    async def _bucket(self) -> KeyValue:
        """The bucket, brought to this gateway's session lifetime once per process."""
        async with self._opening:
            if self._kv is None:
                await bus.ensure_key_value_ttl(self.js, subjects.UI_SESSIONS_BUCKET, self.max_age_s)
                self._kv = await self.js.key_value(subjects.UI_SESSIONS_BUCKET)
            return self._kv

    async def open(self, key_sha256: str) -> str:
        """A new session for the key with this SHA-256; its id, for the cookie."""
        session_id = new_session_id()
        now = time.time()
        record = UiSession(key_sha256=key_sha256, created_at=now, expires_at=now + self.max_age_s)
        kv = await self._bucket()
        await kv.put(_record_name(session_id.encode()), record.model_dump_json().encode())
        return session_id

    async def key_of(self, session_id: bytes) -> str | None:
        """The SHA-256 of the key a live session signed in with; None for no such session (never
        opened, signed out, expired). Raises SessionsUnavailable when NATS does not answer."""
        if not _SESSION_ID.match(session_id):
            return None
        try:
            entry = await (await self._bucket()).get(_record_name(session_id))
        except NotFoundError:  # never opened, signed out (a delete marker), or aged out
            return None
        except (NatsTimeoutError, TimeoutError, NoRespondersError) as exc:
            raise SessionsUnavailable(str(exc) or type(exc).__name__) from exc
        try:
            record = UiSession.model_validate_json(entry.value or b"")
        except ValidationError:
            return None
        # The bucket's TTL counts from the put; another replica may have set a longer one.
        return record.key_sha256 if record.expires_at > time.time() else None

    async def close(self, session_id: bytes) -> None:
        """Sign the session out, on every replica at once."""
        if not _SESSION_ID.match(session_id):
            return
        try:
            await (await self._bucket()).delete(_record_name(session_id))
        except (NatsTimeoutError, TimeoutError, NoRespondersError) as exc:
            raise SessionsUnavailable(str(exc) or type(exc).__name__) from exc
