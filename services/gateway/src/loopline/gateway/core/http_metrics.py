"""The gateway's HTTP metrics: every request counted by route, method and status, its latency, and
``GET /metrics`` on the gateway's own port (the process's whole registry, as the runtime's
``/metrics`` port serves it too).

A request is labelled with its route's template (``/v1/megatron/train/{job}``), never its raw path:
the label values stay as many as the routes, whatever clients send.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request, Response
from prometheus_client import Counter, Histogram
from starlette.routing import BaseRoute, Match

from loopline.common.runtime import metrics
from loopline.gateway.auth.scopes import OPEN
from loopline.gateway.core.recent_requests import RECENT
from loopline.gateway.core.route_spec import declare

REQUESTS = Counter("loopline_gateway_requests", (
    "HTTP requests answered, by route template, method and status."), ["route", "method", "status"])
LATENCY = Histogram("loopline_gateway_request_seconds", (
    "HTTP request latency, from the request's arrival to the last byte of its answer (a stream's "
    "last event), by route template and method."), ["route", "method"], buckets=metrics.LATENCY_BUCKETS)

# What a request no route matches is labelled with (a 404, or one refused before routing).
UNMATCHED = "unmatched"
# Any other method is labelled "other": a method is whatever token a client sends.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class CountRequests:
    """Plain ASGI, outermost, so the count includes what the body limit and API keys refuse and
    the latency covers the whole answer. Per request it costs two dict lookups, a counter and a
    histogram (the labelled children are kept, not looked up in the registry each time)."""

    def __init__(self, app, *, routes: list[BaseRoute]):
        self.app = app
        self.routes = routes
        self._counters: dict[tuple[str, str, int], Counter] = {}
        self._latencies: dict[tuple[str, str], Histogram] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        # What uvicorn answers when the app ends without starting a response: a 500.
        status = 500

        async def send_noting_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            self._record(scope, status, time.perf_counter() - started)

    def _record(self, scope, status: int, seconds: float) -> None:
        route = self._template(scope)
        method = scope["method"] if scope["method"] in METHODS else "other"
        counter = self._counters.get((route, method, status))
        if counter is None:
            counter = self._counters[route, method, status] = REQUESTS.labels(route, method, str(status))
        counter.inc()
        latency = self._latencies.get((route, method))
        if latency is None:
            latency = self._latencies[route, method] = LATENCY.labels(route, method)
        latency.observe(seconds)
        if status < 400:  # a refusal's speed says nothing about serving
            RECENT.record(scope["path"], seconds)

    def _template(self, scope) -> str:
        # The router put the route it matched in the scope (the same dict: routing updates it).
        route = scope.get("route")
        if route is not None:
            return getattr(route, "path", UNMATCHED)
        # Refused before routing (401, 413) or matched by none (404): match it here, off the hot path.
        for candidate in self.routes:
            match, _ = candidate.matches(scope)
            if match is not Match.NONE:
                return getattr(candidate, "path", UNMATCHED)
        return UNMATCHED


def metrics_page(request: Request) -> Response:
    # Synchronous: FastAPI runs it on its thread pool, so rendering never holds up the event loop.
    body, content_type = metrics.exposition(request.headers.get("accept"))
    return Response(body, media_type=content_type)


def install(app: FastAPI) -> None:
    """Add ``GET /metrics`` and the request counting to ``app``; call it once its routes and other
    middleware are in place (middleware added last runs first)."""
    # Open: Prometheus scrapes carry no key (the metrics port has none either).
    app.add_api_route(metrics.PATH, metrics_page, methods=["GET"], response_class=Response,
                      summary="Prometheus metrics of this gateway process",
                      **declare(OPEN, media_type="text/plain"))
    app.add_middleware(CountRequests, routes=app.router.routes)
