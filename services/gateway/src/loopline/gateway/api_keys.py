"""Optional API keys: with ``LOOPLINE_API_KEYS`` set, every ``/v1`` route but the container health
probe wants ``Authorization: Bearer <key>`` (what the ``openai`` client sends as its ``api_key``),
and every Tinker route (``/api/v1``) wants ``X-API-Key: <key>`` (what the ``tinker`` SDK sends; it
insists its keys start with ``tml-``, so give Tinker users such a key).

Off by default, because the ``scalarlm`` client sends no credentials at all: a deployment that turns
keys on serves OpenAI-style clients, or puts ScalarLM clients behind a proxy that adds the header.
"""

from __future__ import annotations

import hmac
import json

from loopline.gateway.errors import error_body

# Probed by container health checks, which carry no key.
OPEN_PATHS = ("/v1/health/keepalive", "/api/v1/healthz")
TINKER_PREFIX = "/api/v1/"


class ApiKeys:
    def __init__(self, app, *, keys: frozenset[str]):
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope, receive, send):
        path = scope["path"] if scope["type"] == "http" else ""
        tinker = path.startswith(TINKER_PREFIX)
        if not (path.startswith("/v1") or tinker) or path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if tinker:
            header = token = headers.get(b"x-api-key", b"")
            scheme = b"bearer"
        else:
            header = headers.get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
        # compare_digest on every key: how long a refusal takes says nothing about the keys (a list:
        # any() over a generator would stop at the first match).
        if scheme.lower() == b"bearer" and any([hmac.compare_digest(token.strip(), k) for k in self.keys]):  # noqa: C419
            return await self.app(scope, receive, send)
        await self._refuse(scope, send, "missing API key" if not header else "invalid API key", tinker)

    async def _refuse(self, scope, send, why: str, tinker: bool):
        how = "'X-API-Key: <key>'" if tinker else "'Authorization: Bearer <key>'"
        message = f"{why}: send {how} with one of this gateway's API keys"
        payload = json.dumps(error_body(scope["path"], 401, message, type="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": payload})
