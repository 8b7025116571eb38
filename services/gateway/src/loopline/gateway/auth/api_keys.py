"""Optional API keys, with scopes and per-key limits. With ``LOOPLINE_API_KEYS`` or
``LOOPLINE_API_KEYS_FILE`` set, every route but the health probes, ``/metrics`` and the OpenAPI
pages wants ``Authorization: Bearer <key>`` (what the ``openai`` client sends as its ``api_key``),
and every Tinker route (``/api/v1``) ``X-API-Key: <key>`` (what the ``tinker`` SDK sends; it insists
its keys start with ``tml-``, as ``loopline keys create`` makes them). The dashboard's pages
(``/ui``) take the session its sign-in opened, too (ui_cookie.py, ui_sessions.py): the key it
signed in with, while that key is still one of the gateway's; a browser that has none is sent to the
sign-in page. No other route takes the cookie, nor takes a session id for a key.

In order, a request is answered 401 (no key, or not one of this gateway's: key_store.py), 403 (the
key lacks the scope its route declares: core/route_spec.py), 429 with ``Retry-After`` (over the key's
queue share or rate: key_limits.py), or let through with its key in ``request.state`` (job
ownership reads it: ``api_key_of``).

Off by default, because the ``scalarlm`` client sends no credentials at all: a deployment that turns
keys on serves OpenAI-style clients, or puts ScalarLM clients behind a proxy that adds the header.
"""

from __future__ import annotations

import json
import re

from fastapi import Request
from starlette.routing import BaseRoute, Route

from loopline.gateway.auth import ui_cookie
from loopline.gateway.auth.key_limits import KeyLimits
from loopline.gateway.auth.key_store import ApiKey, KeyStore
from loopline.gateway.auth.scopes import ANY_KEY, OPEN, allows
from loopline.gateway.auth.ui_sessions import SessionsUnavailable, UiSessions
from loopline.gateway.core.errors import error_body
from loopline.gateway.core.route_spec import scope_of

# The routes that declare OPEN are probed by container health checks (and Prometheus), which carry
# no key; so are FastAPI's pages of the OpenAPI document. Every other path wants a key: vLLM's
# routes outside /v1 (/pooling, /score, /tokenize, ...) included, and a path no route takes (401
# before its 404).
DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
TINKER_PREFIX = "/api/v1/"
LIVE_PATH = "/ui/live"  # an EventSource, not a person: a 401 it can report
STATE_KEY = "api_key"


def api_key_of(request: Request) -> ApiKey | None:
    """The key the request came with; None when the gateway has no keys."""
    return request.scope.get("state", {}).get(STATE_KEY)


class ApiKeys:
    def __init__(self, app, *, store: KeyStore, limits: KeyLimits, routes: list[BaseRoute],
                 sessions: UiSessions):
        self.app = app
        self.store = store
        self.sessions = sessions
        self.limits = limits
        self.routes = routes  # the app's: each declares its scope (route_spec.declare)
        self._exact: dict[tuple[str, str], str] | None = None
        self._templated: list[tuple[re.Pattern[str], frozenset[str], str]] = []

    async def __call__(self, scope, receive, send):
        path = scope["path"] if scope["type"] == "http" else ""
        tinker = path.startswith(TINKER_PREFIX)
        if scope["type"] != "http" or path in DOC_PATHS:
            return await self.app(scope, receive, send)
        need = self._scope_needed(scope)
        if need == OPEN:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        ui = ui_cookie.is_ui_path(path)
        key: ApiKey | None = None
        if tinker:
            header = token = headers.get(b"x-api-key", b"")
            scheme = b"bearer"
        else:
            header = headers.get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if ui and not header and (session := ui_cookie.session_in(headers.get(b"cookie", b""))):
                header, scheme, token = b"cookie", b"session", b""
                try:
                    key = await self._signed_in(session)
                except SessionsUnavailable as exc:
                    return await _refuse(send, path, 503, f"the dashboard's sessions cannot be read "
                                         f"now ({exc}); try again shortly", "service_unavailable")
        # One hash and one dict lookup; the hash of a 256-bit random key says nothing about others.
        if scheme.lower() == b"bearer" and token.strip():
            key = self.store.lookup(token.strip())
        if key is None and ui and scope["method"] in ("GET", "HEAD") and path != LIVE_PATH:
            return await _to_sign_in(send)  # a person at a browser: the sign-in page, not JSON
        if key is None:
            how = "'X-API-Key: <key>'" if tinker else "'Authorization: Bearer <key>'"
            why = "missing API key" if not header else "invalid API key"
            return await _refuse(send, path, 401, f"{why}: send {how} with one of this gateway's API keys",
                                 "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        if not allows(key.scopes, need):
            return await _refuse(send, path, 403, f"API key {key.name!r} lacks the '{need}' scope this "
                                 f"route needs (it has: {', '.join(sorted(key.scopes))})", "permission_error")
        refusal = self.limits.admit(key)
        if refusal is not None:
            return await _refuse(send, path, 429, refusal.message, "rate_limit_error",
                                 [(b"retry-after", str(refusal.retry_after_s).encode())])
        scope.setdefault("state", {})[STATE_KEY] = key
        try:
            await self.app(scope, receive, send)
        finally:
            self.limits.release(key)

    async def _signed_in(self, session: bytes) -> ApiKey | None:
        """The key a dashboard session signed in with, while the key is still valid."""
        signed_with = await self.sessions.key_of(session)
        return self.store.lookup_hash(signed_with) if signed_with is not None else None

    def _scope_needed(self, scope) -> str:
        method = "GET" if scope["method"] == "HEAD" else scope["method"]  # a GET route answers HEAD
        if self._exact is None:  # built at the first request: every route is added by then
            self._exact, self._templated = _scope_tables(self.routes)
        need = self._exact.get((method, scope["path"]))
        if need is not None:  # a path without parameters: most requests, one dict lookup
            return need
        # In the router's order, so the first match is the router's (/train/logs/{job} before
        # /train/{job}/events), over the routes with parameters only: the whole gate then costs
        # 3-4 us a request (measured in-process), Route.matches over every route made it ~50 us.
        # A path no route takes (404, 405) needs only a valid key.
        for regex, methods, need in self._templated:
            if method in methods and regex.match(scope["path"]):
                return need
        return ANY_KEY


def _scope_tables(routes: list[BaseRoute]) -> tuple[dict[tuple[str, str], str],
                                                    list[tuple[re.Pattern[str], frozenset[str], str]]]:
    """What each route declared: by (method, path) for the paths without parameters, and as
    (regex, methods, scope) in the router's order for the others. A route that declared nothing
    (none does: tests/gateway/test_openapi.py) needs a key of any scope."""
    exact: dict[tuple[str, str], str] = {}
    templated: list[tuple[re.Pattern[str], frozenset[str], str]] = []
    for route in routes:
        if not isinstance(route, Route):
            continue
        need = scope_of(route) or ANY_KEY
        if "{" in route.path:
            templated.append((route.path_regex, frozenset(route.methods or ()), need))
        else:
            exact.update({(method, route.path): need for method in route.methods or ()})
    return exact, templated


async def _refuse(send, path: str, status: int, message: str, type: str,
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """The refusal in the route's error shape: OpenAI's on the OpenAI routes, ``{"detail"}`` on
    ScalarLM's and the Tinker API's (errors.error_body)."""
    payload = json.dumps(error_body(path, status, message, type=type)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})


async def _to_sign_in(send) -> None:
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", b"/ui/login"), (b"content-length", b"0"),
                            (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": b""})
