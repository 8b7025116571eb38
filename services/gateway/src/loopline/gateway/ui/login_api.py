"""Signing in to the dashboard with an API key, and out (auth/ui_sessions.py: the browser keeps a
session id, never the key), and the dashboard's static files. All open: they are what a browser
without a key may load."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from loopline.gateway.auth import ui_cookie
from loopline.gateway.auth.api_keys import STATE_KEY
from loopline.gateway.auth.key_store import key_hash
from loopline.gateway.auth.scopes import OPEN
from loopline.gateway.auth.ui_sessions import SessionsUnavailable
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.route_spec import declare
from loopline.gateway.ui.pages import render
from loopline.gateway.ui.pages_api import HTML, page

router = APIRouter(prefix="/ui")

# The form has one field; a key is ~47 characters. Anything longer is not a key.
MAX_KEY_CHARS = 512
# The files static/ holds, by name, with their types: nothing else is served (no path is joined).
STATIC = {"dashboard.css": "text/css; charset=utf-8", "live.js": "text/javascript; charset=utf-8"}


@router.get("/login", **declare(OPEN, media_type=HTML))
async def login_form(request: Request) -> Response:
    return page(render("login.html", title="Sign in", keyed=request.app.state.key_store is not None))


@router.post("/login", **declare(OPEN, {303: "signed in (or no keys to sign in with): to the dashboard",
                                        401: "not one of this gateway's API keys (the page says so)",
                                        400: "no key in the form",
                                        429: "the key signed in too often (max_ui_sessions_per_key)"},
                   media_type=HTML))
async def login(request: Request) -> Response:
    store = request.app.state.key_store
    if store is None:
        return RedirectResponse("/ui", status_code=303)
    async with request.form(max_files=0, max_fields=4, max_part_size=MAX_KEY_CHARS) as form:
        key = form.get("key")
    if not isinstance(key, str) or not key.strip():
        return page(render("login.html", title="Sign in", keyed=True, message="Enter an API key."), 400)
    key = key.strip()
    api_key = store.lookup(key.encode()) if len(key) <= MAX_KEY_CHARS else None
    if api_key is None:
        return page(render("login.html", title="Sign in", keyed=True,
                           message="That is not one of this gateway's API keys "
                                   "(`loopline keys create` makes one)."), 401)
    # Counted against the key signing in, before its session is stored.
    request.scope.setdefault("state", {})[STATE_KEY] = api_key
    request.app.state.ui_session_quota.take(request)
    sessions = request.app.state.ui_sessions
    session_id = await sessions.open(key_hash(key))
    response = RedirectResponse("/ui", status_code=303)
    ui_cookie.remember(response, request, session_id, sessions.max_age_s)
    return response


@router.post("/logout", **declare(OPEN, {303: "signed out: to the sign-in page",
                                         503: "NATS did not answer: not signed out"}, media_type=HTML))
async def logout(request: Request) -> Response:
    response = RedirectResponse("/ui/login", status_code=303)
    session = ui_cookie.session_in(request.headers.get("cookie", "").encode("latin-1"))
    if session is not None and request.app.state.key_store is not None:
        try:
            await request.app.state.ui_sessions.close(session)
        except SessionsUnavailable as exc:  # the session would outlive the sign-out: say so
            raise ApiError(503, f"not signed out: the dashboard's sessions cannot be written now "
                                f"({exc}); try again shortly") from exc
    ui_cookie.forget(response, request)
    return response


@router.get("/static/{name}", **declare(OPEN, {404: "no such file"}, media_type="text/plain"))
async def static(name: str) -> Response:
    media_type = STATIC.get(name)
    if media_type is None:
        raise ApiError(404, f"no static file {name!r}")
    body = resources.files("loopline.gateway.ui").joinpath("static", name).read_bytes()
    return Response(body, media_type=media_type, headers={"Cache-Control": "max-age=300",
                                                          "X-Content-Type-Options": "nosniff"})
