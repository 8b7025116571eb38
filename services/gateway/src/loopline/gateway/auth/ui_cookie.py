"""The dashboard's sign-in: a browser cannot add ``Authorization`` to a page it navigates to, so
``POST /ui/login`` puts the API key in a cookie, and the key check (api_keys.py) takes it from there
for the dashboard's own paths only.

The cookie is ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no request another site
starts carries it) and ``Path=/ui`` (the API routes never see it, so it cannot drive them: they
want the header), and ``Secure`` when the page came over https. A key revoked in the keys file
stops working in the cookie at once, as everywhere.
"""

from __future__ import annotations

from http.cookies import SimpleCookie

from starlette.requests import Request
from starlette.responses import Response

NAME = "loopline_key"
PREFIX = "/ui"
# Signed in for a working day; a closed browser forgets it sooner.
MAX_AGE_S = 12 * 3600


def is_ui_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def key_in(cookie_header: bytes) -> bytes | None:
    """The key the dashboard's cookie holds, from a ``Cookie`` header."""
    if NAME.encode() not in cookie_header:
        return None
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(cookie_header.decode("latin-1"))
    except Exception:  # noqa: BLE001 - a malformed header holds no key
        return None
    morsel = jar.get(NAME)
    return morsel.value.encode("latin-1") if morsel is not None and morsel.value else None


def _secure(request: Request) -> bool:
    forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return request.url.scheme == "https" or forwarded == "https"


def remember(response: Response, request: Request, key: str) -> None:
    response.set_cookie(NAME, key, max_age=MAX_AGE_S, path=PREFIX, httponly=True, samesite="strict",
                        secure=_secure(request))


def forget(response: Response, request: Request) -> None:
    response.delete_cookie(NAME, path=PREFIX, httponly=True, samesite="strict", secure=_secure(request))
