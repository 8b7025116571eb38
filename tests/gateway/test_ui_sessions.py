"""The dashboard's sign-in keeps a session, not the key (auth/ui_sessions.py, auth/ui_cookie.py), on
a real gateway process with API keys and a real nats-server (no trainer: these keys sign in, read the
overview and sign out), and a real headless Chromium (support/browser.py) for what a server on
another port of the same host receives.

Asserted: the cookie holds an opaque session id and never the key; the id is no key on any API route
(as ``Authorization``, ``X-API-Key`` or the cookie); signing out, revoking the key and rotating it
each end the session; over https the cookie is ``__Host-`` prefixed; a session ends at its max age
even where the bucket keeps it longer; and one key's sign-ins are limited.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from loopline.common.local import launcher
from loopline.gateway.auth import ui_cookie
from loopline.gateway.auth.key_store import KeyEntry, KeyFile, key_hash, new_key, write_key_file
from loopline.gateway.auth.ui_sessions import UiSessions
from support.browser import Browser, other_site, require_chromium
from support.gateway_process import start_gateway

KEYS = {name: new_key() for name in ("a", "b", "rotated", "revoked", "many", "viewer")}
SCOPES = {"a": ["training", "inference"], "b": ["inference"], "rotated": ["inference"],
          "revoked": ["inference"], "many": ["inference"], "viewer": ["inference"]}
SIGN_INS = 3  # LOOPLINE_MAX_UI_SESSIONS_PER_KEY here
API = "/v1/models"  # any key's route, answered by the gateway alone


def write_keys(path, keys: dict[str, str]) -> None:
    write_key_file(path, KeyFile(keys=[KeyEntry(name=name, sha256=key_hash(key), scopes=SCOPES[name])
                                       for name, key in keys.items()]))


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api_keys.json"
    write_keys(path, KEYS)
    return path


@pytest.fixture(scope="module")
def keyed(nats_proc, keys_file, tmp_path_factory):
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("sessions"),
                       LOOPLINE_API_KEYS_FILE=str(keys_file),
                       LOOPLINE_MAX_UI_SESSIONS_PER_KEY=str(SIGN_INS))
    yield gw
    launcher.stop(gw.proc)


def client(gw, **kw) -> httpx.Client:
    return httpx.Client(base_url=gw.url, timeout=30, **kw)


def sign_in(gw, name: str, **headers: str) -> httpx.Response:
    with client(gw) as anon:
        signed = anon.post("/ui/login", data={"key": KEYS[name]}, headers=headers)
    assert signed.status_code == 303, signed.text
    return signed


def session_of(signed: httpx.Response, name: str = ui_cookie.PLAIN_NAME) -> str:
    return signed.cookies[name]


def opens_dashboard(gw, session: str, name: str = ui_cookie.PLAIN_NAME) -> bool:
    with client(gw, cookies={name: session}) as browser:
        page = browser.get("/ui")
    assert page.status_code in (200, 303), page.text
    return page.status_code == 200


def test_sign_in_keeps_a_session_not_the_key_and_sign_out_ends_it(keyed):
    signed = sign_in(keyed, "a")
    set_cookie = "\n".join(signed.headers.get_list("set-cookie"))
    assert KEYS["a"] not in set_cookie
    session = session_of(signed)
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", session)
    cookie = next(c for c in signed.headers.get_list("set-cookie") if c.startswith(ui_cookie.PLAIN_NAME))
    assert {"httponly", "samesite=strict", "path=/ui"} <= {p.strip().lower() for p in cookie.split(";")}
    with client(keyed, cookies={ui_cookie.PLAIN_NAME: session}) as browser:
        page = browser.get("/ui")
        assert page.status_code == 200 and "key <b>a</b>" in page.text
        # The session is the dashboard's: an API route takes it neither from the cookie nor as a key.
        assert browser.get(API).status_code == 401
    for headers in ({"Authorization": f"Bearer {session}"}, {"X-API-Key": session}):
        with client(keyed, headers=headers) as api:
            assert api.get(API).status_code == 401
            assert api.get("/api/v1/client/config").status_code == 401
            assert api.get("/ui").headers.get("location") == "/ui/login"
    # Signing out ends the session itself, not only the browser's copy: the old cookie opens nothing.
    with client(keyed, cookies={ui_cookie.PLAIN_NAME: session}) as browser:
        out = browser.post("/ui/logout")
        assert out.status_code == 303 and out.headers["location"] == "/ui/login"
    assert not opens_dashboard(keyed, session)
    with client(keyed, cookies={ui_cookie.PLAIN_NAME: session}) as stale:
        assert stale.get("/ui/live?page=overview").status_code == 401
    # A made-up id is no session either.
    assert not opens_dashboard(keyed, "x" * 43)


def test_revoking_or_rotating_the_key_ends_its_sessions(keyed, keys_file):
    sessions = {name: session_of(sign_in(keyed, name)) for name in ("b", "rotated", "revoked")}
    assert all(opens_dashboard(keyed, s) for s in sessions.values())
    # `loopline keys revoke` drops an entry; rotating gives the name a new key (a new hash).
    kept = {name: key for name, key in KEYS.items() if name != "revoked"}
    kept["rotated"] = new_key()
    write_keys(keys_file, kept)
    try:
        deadline = time.monotonic() + 10  # the gateway re-reads the file at most once a second
        while opens_dashboard(keyed, sessions["revoked"]) or opens_dashboard(keyed, sessions["rotated"]):
            assert time.monotonic() < deadline, "a revoked or rotated key's session still opens /ui"
            time.sleep(0.2)
        assert opens_dashboard(keyed, sessions["b"])  # another key's session is untouched
    finally:
        write_keys(keys_file, KEYS)


def test_over_https_the_cookie_is_host_prefixed_and_still_no_key_for_the_api(keyed):
    # A TLS-ending proxy says https (X-Forwarded-Proto): the cookie must be Secure, and then may be
    # __Host- prefixed, which needs Path=/ and no Domain: the browser sends it to the API paths too.
    signed = sign_in(keyed, "a", **{"X-Forwarded-Proto": "https"})
    cookie = next(c for c in signed.headers.get_list("set-cookie") if c.startswith(ui_cookie.SECURE_NAME))
    parts = {p.strip().lower() for p in cookie.split(";")}
    assert {"secure", "httponly", "samesite=strict", "path=/"} <= parts
    assert not any(p.startswith("domain") for p in parts)
    session = cookie.split(";")[0].partition("=")[2]
    assert KEYS["a"] not in cookie
    assert opens_dashboard(keyed, session, ui_cookie.SECURE_NAME)
    with client(keyed, cookies={ui_cookie.SECURE_NAME: session}) as browser:
        assert browser.get(API).status_code == 401


def test_one_key_signs_in_a_bounded_number_of_times(keyed):
    for _ in range(SIGN_INS):
        sign_in(keyed, "many")
    with client(keyed) as anon:
        refused = anon.post("/ui/login", data={"key": KEYS["many"]})
    assert refused.status_code == 429, refused.text
    assert "LOOPLINE_MAX_UI_SESSIONS_PER_KEY" in refused.text and "Retry-After" in refused.headers
    assert "set-cookie" not in refused.headers
    sign_in(keyed, "b")  # another key is not held up


async def test_a_session_ends_at_its_max_age_even_where_the_bucket_keeps_it_longer(nc):
    short = UiSessions(nc.jetstream(), max_age_s=1.0)
    session = await short.open(key_hash("tml-some-key"))
    assert await short.key_of(session.encode()) == key_hash("tml-some-key")
    # Another replica configured for longer sessions brings the bucket's TTL up: the record's own
    # expiry still ends this one.
    longer = UiSessions(nc.jetstream(), max_age_s=3600)
    fresh = await longer.open(key_hash("tml-other-key"))
    await asyncio.sleep(1.2)
    assert await longer.key_of(session.encode()) is None
    assert await longer.key_of(fresh.encode()) == key_hash("tml-other-key")
    await longer.close(fresh.encode())
    assert await longer.key_of(fresh.encode()) is None


def test_a_server_on_another_port_of_the_host_gets_no_key(keyed, tmp_path):
    """Browsers send a host's cookies to each of its ports: a server another user runs on
    127.0.0.1 receives the dashboard's cookie. It must hold nothing that opens the API."""
    require_chromium()
    with Browser(tmp_path / "chromium") as browser, other_site("127.0.0.1") as neighbour:
        page = browser.page()
        page.open(f"{keyed.url}/ui")
        assert page.evaluate("location.pathname") == "/ui/login"
        page.evaluate(f"document.getElementById('key').value = {KEYS['viewer']!r}")
        page.evaluate("document.querySelector('form.login').submit()")
        page.wait_for("location.pathname === '/ui' && document.readyState === 'complete'")
        page.open(f"{neighbour.url}ui/anything")  # Path=/ui: the neighbour serves that path too
        page.wait_for("document.readyState === 'complete'")
    [received] = [c for c in neighbour.cookies if c]
    assert KEYS["viewer"] not in received
    session = re.search(rf"{ui_cookie.PLAIN_NAME}=([A-Za-z0-9_-]+)", received)
    assert session is not None, received  # the cookie did reach the neighbour: what it holds is moot
    stolen = session.group(1)
    for headers in ({"Authorization": f"Bearer {stolen}"}, {"Cookie": received}):
        with client(keyed, headers=headers) as api:
            assert api.get(API).status_code == 401
            assert api.post("/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 401
    with client(keyed, headers={"X-API-Key": stolen}) as tinker:
        assert tinker.get("/api/v1/client/config").status_code == 401
