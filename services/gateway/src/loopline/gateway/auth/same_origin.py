"""Refuse what a web page in a browser sends the gateway from another origin.

A ``multipart/form-data``, ``text/plain`` or form POST is a CORS "simple" request: a browser sends
it without asking first, so any page its user visits could ``fetch(..., {mode: "no-cors"})`` a
training archive (whose shipped ``ml/`` code then runs), clear the queue or spend the deployment's
compute, against a gateway on the user's own machine (``make up``) or network. It cannot read the
answer, but the harm is done by then. Browsers say where a request comes from (``Origin`` on every
state-changing request, ``Sec-Fetch-Site`` on every request to an https or localhost origin) and a
page cannot forge either, so the gateway refuses, with 403, a request that is not GET, HEAD or
OPTIONS when

- ``Origin`` is present and is neither the gateway's own origin (the scheme, or a TLS-ending
  proxy's ``X-Forwarded-Proto``, and the ``Host`` the request came to) nor one of
  ``LOOPLINE_ALLOWED_ORIGINS`` (``Origin: null``, a sandboxed frame or a ``file:`` page, is never
  either), or
- ``Sec-Fetch-Site`` is ``cross-site`` or ``same-site`` and ``Origin`` is not an allowed one, or
- the gateway listens on a loopback address and the page reached it by a name that is not this
  machine's (``localhost``, a loopback address): DNS rebinding, where a page's own name is made to
  resolve to 127.0.0.1, so that the browser takes the gateway for the page's origin. Such a page
  could read what it fetches, and over plain http its fetches carry neither header, so a loopback
  gateway refuses every request, of any method and from any client, that names it otherwise
  (``Host``), unless it comes from an allowed origin.

Clients that are not browsers (openai, scalarlm, the tinker SDK, curl, the CLI) send neither header
and are let through as before (on a loopback gateway, when they name it localhost or a loopback
address, as they do). Plain ASGI and outside the API keys and the body limit, so a refused
request is answered before its key is looked at or any of its body is read.
"""

from __future__ import annotations

import ipaddress
import json
import logging

from loopline.gateway.core.errors import error_body

# What cannot change state (and CORS preflights, which a gateway without CORS never approves).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Sec-Fetch-Site values that say the page is not the gateway's own ("same-site" is another port or
# subdomain: another origin all the same).
FOREIGN_SITES = frozenset({b"cross-site", b"same-site"})
SETTING = "LOOPLINE_ALLOWED_ORIGINS"
DEFAULT_PORTS = {"http": "80", "https": "443"}
log = logging.getLogger(__name__)


def normalize_origin(origin: str) -> str:
    """``scheme://host[:port]`` lower-cased, without a trailing slash or the scheme's default port,
    as browsers write ``Origin``."""
    origin = origin.strip().rstrip("/").lower()
    scheme, sep, host = origin.partition("://")
    port = DEFAULT_PORTS.get(scheme)
    if sep and port and host.endswith(f":{port}"):
        host = host[: -len(port) - 1]
    return f"{scheme}{sep}{host}"


class SameOrigin:
    def __init__(self, app, *, allowed: frozenset[str], loopback: bool):
        self.app = app
        self.allowed = frozenset(normalize_origin(o) for o in allowed)
        self.loopback = loopback  # the gateway listens on a loopback address: only names of it are its

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (scope["method"] in SAFE_METHODS and not self.loopback):
            return await self.app(scope, receive, send)
        origin, site, host = _browser_headers(scope)
        page = normalize_origin(origin.decode("latin-1")) if origin is not None else None
        if page is not None and page in self.allowed:
            return await self.app(scope, receive, send)
        # A rebound page's fetches carry neither header over plain http (browsers send fetch
        # metadata to trustworthy origins only, Origin on a same-origin GET not at all): on a
        # loopback gateway the name it was reached by decides, whoever asks.
        why = self._rebound(host)
        if why is None and scope["method"] not in SAFE_METHODS and (origin is not None or site is not None):
            why = self._refusal(scope, page, site, host)
        if why is None:  # not a browser (or one too old to say), or the gateway's own page
            return await self.app(scope, receive, send)
        log.info("refused a cross-site %s %s: %s", scope["method"], scope["path"], why)
        message = (f"cross-site request refused: {why}. The gateway accepts state-changing requests "
                   f"from browser pages of its own origin only, and on a loopback address browser "
                   f"requests that name it localhost or a loopback address; list other trusted "
                   f"origins in {SETTING} (comma-separated, e.g. https://app.example.com)")
        payload = json.dumps(error_body(scope["path"], 403, message, type="permission_error")).encode()
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    def _refusal(self, scope, page: str | None, site: bytes | None, host: bytes | None) -> str | None:
        """Why a browser's state-changing request is refused, or None to let it through."""
        if page == "null":  # sandboxed frames, file: pages, some redirects: no origin to trust
            return "a browser page sent it with 'Origin: null'"
        if site is not None and site.strip().lower() in FOREIGN_SITES:
            named = f" (Origin {page!r})" if page is not None else ""
            return f"a browser page of another site sent it (Sec-Fetch-Site: {site.decode('latin-1')}){named}"
        name = (host or b"").decode("latin-1")
        own = normalize_origin(f"{scope.get('scheme', 'http')}://{name}")
        if page is not None and page != own and page != _forwarded_origin(scope, name):
            return f"a browser page of origin {page!r} sent it, not one of this gateway's"
        return None

    def _rebound(self, host: bytes | None) -> str | None:
        """Why a request to a loopback gateway by a name that is not this machine's is refused (DNS
        rebinding), or None. A request without ``Host`` (HTTP/1.0) came from no browser."""
        if not self.loopback or host is None:
            return None
        name = host.decode("latin-1")
        if is_loopback_name(name):
            return None
        return (f"this gateway listens on a loopback address and was reached as {name!r}, a name "
                f"that is not this machine's (DNS rebinding?): ask it as localhost or 127.0.0.1")


def _browser_headers(scope) -> tuple[bytes | None, bytes | None, bytes | None]:
    """``Origin``, ``Sec-Fetch-Site`` and ``Host``, each None when absent."""
    origin = site = host = None
    for name, value in scope["headers"]:  # a few headers: cheaper than building a dict
        if name == b"origin":
            origin = value
        elif name == b"sec-fetch-site":
            site = value
        elif name == b"host":
            host = value
    return origin, site, host


def foreign_page(scope, allowed: frozenset[str]) -> str | None:
    """Why a request of any method, GETs included, was sent by a browser page that is neither the
    gateway's own nor of an ``allowed`` origin; None when it was not (not a browser, or its own
    page). For the GETs that hold something of their caller's while they last: an event stream
    holds one of its client's few slots (core/event_streams.py), which any page the user visits
    could otherwise take, all of them, with ``new EventSource``."""
    origin, site, host = _browser_headers(scope)
    if origin is None and site is None:
        return None
    page = normalize_origin(origin.decode("latin-1")) if origin is not None else None
    guard = SameOrigin(None, allowed=allowed, loopback=False)
    if page is not None and page in guard.allowed:
        return None
    return guard._refusal(scope, page, site, host)


def _forwarded_origin(scope, host: str) -> str | None:
    """The gateway's origin as the client saw it through a proxy that ends TLS (``X-Forwarded-Proto:
    https``, as ingresses send): a page cannot set that header (not CORS-safelisted: a no-cors fetch
    drops it, any other asks first, and the gateway approves no preflight), so it is not the
    attacker's to forge."""
    proto = next((v for k, v in scope["headers"] if k == b"x-forwarded-proto"), None)
    if proto is None:
        return None
    scheme = proto.decode("latin-1").split(",")[0].strip().lower()
    return normalize_origin(f"{scheme}://{host}") if scheme in DEFAULT_PORTS else None


def is_loopback_name(host: str) -> bool:
    """Whether ``host`` (a Host header: name or address, maybe a port) names this machine as every
    resolver must: ``localhost`` and its subdomains (RFC 6761), a loopback address."""
    name = host.strip().lower()
    if name.startswith("["):  # [::1]:8000
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:  # name:port (more than one colon: a bare IPv6 address)
        name = name.partition(":")[0]
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
