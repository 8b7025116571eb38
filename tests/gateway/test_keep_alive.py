"""Idle HTTP connections on a real gateway process: kept past uvicorn's own 5 s default, so clients
and load balancers can reuse them, and closed once ``LOOPLINE_KEEP_ALIVE_S`` has passed."""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit

import pytest

from loopline.common.local import launcher
from support.gateway_process import start_gateway


def _connect(url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)


def _probe(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/v1/health/keepalive")
    response = conn.getresponse()
    response.read()
    return response.status


@pytest.fixture(scope="module")
def short_keep_alive_gateway(nats_proc, tmp_path_factory):
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("keep-alive"),
                       LOOPLINE_KEEP_ALIVE_S="1")
    yield gw
    launcher.stop(gw.proc)


# Tier: holds a connection idle past uvicorn's default, ~6 s.
@pytest.mark.slow
def test_idle_connection_outlives_uvicorns_default(gateway):
    conn = _connect(gateway.url)
    try:
        assert _probe(conn) == 200
        sock = conn.sock
        time.sleep(6)  # uvicorn alone would have closed it after 5 s
        assert _probe(conn) == 200  # a closed connection raises RemoteDisconnected here
        assert conn.sock is sock, "the second request needed a new connection"
    finally:
        conn.close()


def test_connection_is_closed_after_the_configured_idle_time(short_keep_alive_gateway):
    conn = _connect(short_keep_alive_gateway.url)
    try:
        assert _probe(conn) == 200
        conn.sock.settimeout(5)
        started = time.monotonic()
        assert conn.sock.recv(1) == b"", "the server sent data instead of closing"
        assert time.monotonic() - started < 4
    finally:
        conn.close()
