"""The dashboard's sign-in cookie: a browser cannot add ``Authorization`` to a page it navigates to,
so ``POST /ui/login`` opens a session (ui_sessions.py) and puts its id, never the key, in a cookie
that the key check (api_keys.py) reads on the dashboard's own paths only.

The cookie is ``HttpOnly`` (no script reads it) and ``SameSite=Strict`` (no request another site
starts carries it: the dashboard's own defence against cross-site forms, beside same_origin.py).
Over https it is ``__Host-loopline_session``: ``Secure``, ``Path=/`` and no ``Domain``, which the
prefix makes the browser enforce, so no other host or plain-http page can set or shadow it. Over
plain http (``make up`` on 127.0.0.1) it is ``loopline_session`` with ``Path=/ui``. Either way the
API routes never take it (api_keys.py), so what another port of the host reads of it drives no API.
"""

from __future__ import annotations

from http.cookies import SimpleCookie

from starlette.requests import Request
from starlette.responses import Response

PLAIN_NAME = "loopline_session"
SECURE_NAME = "__Host-loopline_session"  # the __Host- prefix requires Secure, Path=/ and no Domain
# Before sessions the cookie held the key itself: sign-in and sign-out delete what is left of it.
LEGACY_KEY_NAME = "loopline_key"
PREFIX = "/ui"


def is_ui_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def session_in(cookie_header: bytes) -> bytes | None:
    """The session id the dashboard's cookie holds, from a ``Cookie`` header."""
    if PLAIN_NAME.encode() not in cookie_header:  # both names contain it
        return None
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(cookie_header.decode("latin-1"))
    except Exception:  # noqa: BLE001 - a malformed header holds no session
        return None
    for name in (SECURE_NAME, PLAIN_NAME):
        morsel = jar.get(name)
        if morsel is not None and morsel.value:
            return morsel.value.encode("latin-1")
    return None


def is_secure(request: Request) -> bool:
    forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return request.url.scheme == "https" or forwarded == "https"


def _name_and_path(request: Request) -> tuple[str, str]:
    return (SECURE_NAME, "/") if is_secure(request) else (PLAIN_NAME, PREFIX)


def remember(response: Response, request: Request, session_id: str, max_age_s: float) -> None:
    name, path = _name_and_path(request)
    response.set_cookie(name, session_id, max_age=int(max_age_s), path=path, httponly=True,
                        samesite="strict", secure=is_secure(request))
    _forget_legacy_key(response, request)


def forget(response: Response, request: Request) -> None:
    name, path = _name_and_path(request)
    response.delete_cookie(name, path=path, httponly=True, samesite="strict", secure=is_secure(request))
    _forget_legacy_key(response, request)


def _forget_legacy_key(response: Response, request: Request) -> None:
    response.delete_cookie(LEGACY_KEY_NAME, path=PREFIX, httponly=True, samesite="strict",
                           secure=is_secure(request))
