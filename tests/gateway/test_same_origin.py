"""Cross-site requests (auth/same_origin.py), in-process: the gateway's FastAPI app over a real
Gateway on a real nats-server, asked through httpx's ASGI transport as a browser would ask it
(``Origin``, ``Sec-Fetch-Site``) and as the clients that are not browsers do (neither header).

A state-changing request a browser page of another origin sends is refused with 403 in its route's
error shape, naming why and ``LOOPLINE_ALLOWED_ORIGINS``, before its key is looked at or its body
read; the gateway's own pages, the allowed origins, safe methods and header-less clients pass. A
gateway on a loopback address refuses a page that reached it by another name (DNS rebinding).
(tests/gateway/test_cross_site_browser.py sends the same from a real Chromium.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from loopline.common.config.settings import GatewaySettings
from loopline.gateway.app import create_app
from loopline.gateway.auth.same_origin import is_loopback_name, normalize_origin
from loopline.gateway.gateway import Gateway

OWN = "http://127.0.0.1:8000"  # the base URL the client asks: the gateway's own origin
TRUSTED = "https://app.example.com"
KEY = "a-key"
# Let through, it reaches the route (answered {}, the tinker SDK's defaults); no other service needed.
ROUTE = "/api/v1/client/config"


@pytest.fixture
def gateway_client(nc, tmp_path) -> Callable:
    @asynccontextmanager
    async def client(**settings: object) -> AsyncIterator[httpx.AsyncClient]:
        settings.setdefault("allowed_origins", f"{TRUSTED}, http://localhost:3000/")
        config = GatewaySettings(nats_url="nats://unused", state_dir=tmp_path, **settings)
        gateway = Gateway(nc, nc.jetstream(), config)
        await gateway.start()
        try:
            transport = httpx.ASGITransport(app=create_app(config, gateway))
            async with httpx.AsyncClient(transport=transport, base_url=OWN) as http:
                yield http
        finally:
            await gateway.stop()
    return client


# (Origin, Sec-Fetch-Site, what the gateway answers): every combination a browser or a client sends.
CASES = [
    (None, None, 200),  # openai, scalarlm, tinker, curl, the CLI
    (OWN, None, 200),  # the gateway's own page, a browser that sends no Sec-Fetch-Site
    (OWN, "same-origin", 200),
    (f"{OWN}/", "same-origin", 200),  # written with a trailing slash
    (None, "same-origin", 200),
    (None, "none", 200),  # the user typed it (a bookmark, the address bar)
    (TRUSTED, "cross-site", 200),  # LOOPLINE_ALLOWED_ORIGINS
    ("HTTPS://APP.EXAMPLE.COM:443", None, 200),  # the same origin, written otherwise
    ("http://localhost:3000", "same-site", 200),  # allowed, listed with a trailing slash
    ("http://evil.example", "cross-site", 403),  # a page anywhere on the web
    ("http://evil.example", None, 403),  # a browser without Sec-Fetch-Site
    ("http://127.0.0.1:9000", "same-site", 403),  # another port on the same host: another origin
    ("https://127.0.0.1:8000", None, 403),  # another scheme: another origin
    ("http://127.0.0.1:8000.evil.example", None, 403),  # the own origin as a prefix only
    ("null", "cross-site", 403),  # a sandboxed frame, a file: page
    ("null", None, 403),
    (None, "cross-site", 403),  # a browser that sends Sec-Fetch-Site but no Origin
    (None, "same-site", 403),
    (OWN, "cross-site", 403),  # contradictory: the browser's word that it is another site wins
]


async def test_state_changing_requests_from_other_origins_are_refused(gateway_client):
    # One app for the whole table: starting a Gateway costs half a second.
    async with gateway_client() as http:
        for origin, site, status in CASES:
            case = f"Origin {origin}, Sec-Fetch-Site {site}"
            headers = {k: v for k, v in {"Origin": origin, "Sec-Fetch-Site": site}.items() if v is not None}
            resp = await http.post(ROUTE, headers=headers)
            assert resp.status_code == status, (case, resp.text)
            if status == 200:
                assert resp.json() == {}, case  # the route's own answer (its defaults)
                continue
            detail = resp.json()["detail"]
            assert "cross-site request refused" in detail and "LOOPLINE_ALLOWED_ORIGINS" in detail, case
            # It says why: the origin it came from, or what the browser said of it.
            if origin == "null":
                assert "Origin: null" in detail, case
            elif origin is not None:
                assert f"'{normalize_origin(origin)}'" in detail, (case, detail)
            else:
                assert f"Sec-Fetch-Site: {site}" in detail, (case, detail)


async def test_a_loopback_gateway_reached_by_another_name_is_refused(gateway_client):
    # DNS rebinding: evil.example made to resolve to 127.0.0.1, so the browser takes the gateway
    # for the page's own origin (Origin and Host agree, Sec-Fetch-Site says same-origin).
    rebound = {"Host": "evil.example:8000", "Origin": "http://evil.example:8000",
               "Sec-Fetch-Site": "same-origin"}
    async with gateway_client() as http:  # listens on 127.0.0.1, as make up's
        resp = await http.post(ROUTE, headers=rebound)
        assert resp.status_code == 403 and "DNS rebinding" in resp.json()["detail"], resp.text
        for name in ("localhost:8000", "app.localhost:8000", "127.0.0.2:8000", "[::1]:8000", "127.0.0.1"):
            own = {"Host": name, "Origin": f"http://{name}", "Sec-Fetch-Site": "same-origin"}
            assert (await http.post(ROUTE, headers=own)).json() == {}, name
        # A rebound page's plain-http fetches look like any client's: the name decides, whoever asks.
        resp = await http.post(ROUTE, headers={"Host": "evil.example:8000"})
        assert resp.status_code == 403 and "localhost or 127.0.0.1" in resp.json()["detail"], resp.text
    async with gateway_client(allowed_origins="http://evil.example:8000") as http:  # trusted, then
        assert (await http.post(ROUTE, headers=rebound)).json() == {}
    async with gateway_client(host="0.0.0.0") as http:  # a served name's own pages
        assert (await http.post(ROUTE, headers=rebound)).json() == {}


async def test_a_rebound_page_cannot_read_a_loopback_gateway_either(gateway_client):
    # After rebinding, the page's GETs are same-origin to the browser, which hands it the answer;
    # over plain http they carry no Origin and no Sec-Fetch-Site: only the name tells.
    rebound = {"Host": "evil.example:8000"}
    async with gateway_client() as http:
        resp = await http.get("/v1/models", headers=rebound)
        assert resp.status_code == 403 and "DNS rebinding" in resp.text, resp.text
        resp = await http.get("/v1/megatron/events", headers={**rebound, "Sec-Fetch-Site": "same-origin"})
        assert resp.status_code == 403 and "DNS rebinding" in resp.json()["detail"], resp.text
        # Its own names, and a page of a trusted origin, still read.
        for headers in ({"Host": "localhost:8000", "Sec-Fetch-Site": "same-origin"},
                        {"Host": "127.0.0.1:8000"},
                        {**rebound, "Origin": TRUSTED}):
            resp = await http.get("/v1/health/keepalive", headers=headers)
            assert resp.json() == {"status": "ok"}, headers
    async with gateway_client(host="0.0.0.0") as http:  # a served name: its pages are its own
        assert (await http.get("/v1/health/keepalive", headers=rebound)).json() == {"status": "ok"}


async def test_the_origin_a_tls_ending_proxy_forwards_is_the_gateways_own(gateway_client):
    # An ingress ends TLS: the page is https://gw.example, the gateway hears http from it.
    page = {"Host": "gw.example", "Origin": "https://gw.example", "Sec-Fetch-Site": "same-origin"}
    async with gateway_client(host="0.0.0.0") as http:
        assert (await http.post(ROUTE, headers={**page, "X-Forwarded-Proto": "https"})).json() == {}
        assert (await http.post(ROUTE, headers=page)).status_code == 403
        # It names the gateway's scheme, not any origin: another host is still another origin.
        other = {**page, "Origin": "https://evil.example", "X-Forwarded-Proto": "https"}
        assert (await http.post(ROUTE, headers=other)).status_code == 403


async def test_safe_methods_are_not_refused(gateway_client):
    async with gateway_client() as http:
        evil = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
        assert (await http.get("/v1/health/keepalive", headers=evil)).json() == {"status": "ok"}
        assert (await http.head("/v1/health/keepalive", headers=evil)).status_code == 405  # FastAPI's
        # A CORS preflight is not approved (the gateway has no CORS), so no non-simple request follows.
        preflight = await http.options(ROUTE, headers={"Origin": "http://evil.example",
                                                       "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers


async def test_openai_routes_are_refused_in_openais_shape(gateway_client):
    async with gateway_client() as http:
        resp = await http.post("/v1/completions", content=b'{"model": "m", "prompt": "x"}',
                               headers={"Origin": "http://evil.example", "Content-Type": "text/plain"})
    assert resp.status_code == 403
    error = resp.json()["error"]
    assert error["type"] == "permission_error" and "'http://evil.example'" in error["message"]


async def test_the_refusal_comes_before_the_key_and_the_body(gateway_client):
    evil = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
    async with gateway_client(api_keys=KEY, max_body_bytes=1024) as http:
        # No key: a browser page gets 403 (why: cross-site), a client 401 as before.
        assert (await http.post(ROUTE, headers=evil)).status_code == 403
        assert (await http.post(ROUTE)).status_code == 401
        # A valid key does not make a cross-site request acceptable (a page cannot set one, but a
        # proxy in front might add it).
        keyed = {"Authorization": f"Bearer {KEY}", "X-API-Key": KEY}
        assert (await http.post(ROUTE, headers={**evil, **keyed})).status_code == 403
        assert (await http.post(ROUTE, headers=keyed)).status_code == 200
        # Over the body limit: refused as cross-site before a byte of the body counts.
        big = b"x" * 4096
        assert (await http.post(ROUTE, headers={**evil, **keyed}, content=big)).status_code == 403
        assert (await http.post(ROUTE, headers=keyed, content=big)).status_code == 413


def test_loopback_names():
    assert all(map(is_loopback_name, ["localhost", "LOCALHOST:80", "a.localhost:1", "127.0.0.1:8000",
                                      "127.1.2.3", "[::1]:8000", "::1"]))
    assert not any(map(is_loopback_name, ["evil.example:8000", "localhost.evil.example", "10.0.0.1",
                                          "[::2]:80", "0.0.0.0:8000", ""]))


def test_origins_are_compared_as_browsers_write_them():
    assert normalize_origin("HTTP://Example.COM:80/") == "http://example.com"
    assert normalize_origin("https://example.com:443") == "https://example.com"
    assert normalize_origin("https://example.com:8443") == "https://example.com:8443"
    assert normalize_origin("null") == "null"
