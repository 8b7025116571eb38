"""The gateway's FastAPI application: routes, error shapes, body limits, tracing. The parts the routes
use (gateway.py) are built and started before it serves (service.py)."""

from __future__ import annotations

import ipaddress
import logging

from fastapi import FastAPI
from opentelemetry import trace

from loopline.common.config.settings import GatewaySettings
from loopline.common.runtime.telemetry import tracer
from loopline.gateway.auth.api_keys import ApiKeys
from loopline.gateway.auth.key_limits import KeyLimits
from loopline.gateway.auth.key_store import KeyStore
from loopline.gateway.auth.same_origin import SameOrigin
from loopline.gateway.auth.ui_sessions import UiSessions
from loopline.gateway.core import errors, openapi_docs
from loopline.gateway.core.body_limit import BodyLimit
from loopline.gateway.core.limits import WindowQuota
from loopline.gateway.gateway import Gateway
from loopline.gateway.openai import routers as openai
from loopline.gateway.scalarlm import routers as scalarlm
from loopline.gateway.scalarlm.upload_chunks import ChunkStaging
from loopline.gateway.tinker import routers as tinker
from loopline.gateway.ui import routers as ui

# Every surface's routers, in the order the app includes them (the OpenAPI test reads them too).
ROUTERS = (*openai.ROUTERS, *scalarlm.ROUTERS, *tinker.ROUTERS, *ui.ROUTERS)
_tracer = tracer("loopline.gateway")
log = logging.getLogger(__name__)


class TraceRequests:
    """One span per HTTP request; what the handlers publish carries it in NATS headers. Plain ASGI:
    Starlette's ``@app.middleware("http")`` wrapper cost a fifth of the gateway's CPU per request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        with _tracer.start_as_current_span(f"{scope['method']} {scope['path']}", kind=trace.SpanKind.SERVER):
            await self.app(scope, receive, send)


def create_app(settings: GatewaySettings, gateway: Gateway) -> FastAPI:
    app = FastAPI(title="Loopline gateway", version="0.1.0")
    app.state.settings = settings
    app.state.gateway = gateway  # gateway_of(request)
    app.state.key_store = None  # the gateway's API keys, when it has some
    app.state.upload_staging = ChunkStaging(settings.state_dir / "uploads", settings.upload_ttl_s)
    errors.install(app)

    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes,
                       max_upload_bytes=settings.max_upload_bytes)
    keyed = bool(settings.api_key_set) or settings.api_keys_file is not None
    if keyed:
        # Outside the body limit: an unauthenticated client gets 401 before any body is read.
        # The dashboard's sign-in (ui/login_api.py) checks a key against the same store.
        app.state.key_store = KeyStore(settings.api_keys_file, settings.api_key_set)
        app.state.ui_sessions = UiSessions(gateway.js, settings.ui_session_max_age_s)
        app.state.ui_session_quota = WindowQuota(settings.max_ui_sessions_per_key,
                                                 settings.ui_session_max_age_s, "max_ui_sessions_per_key",
                                                 "dashboard sign-ins")
        app.add_middleware(ApiKeys, store=app.state.key_store, sessions=app.state.ui_sessions,
                           limits=KeyLimits(settings.retry_after_s), routes=app.router.routes)
    elif not _is_loopback(settings.host):
        log.warning("the gateway listens on %s with no API keys: anyone who can reach it can infer, "
                    "train and clear the queue; set LOOPLINE_API_KEYS_FILE (`loopline keys create`) "
                    "or listen on 127.0.0.1", settings.host)
    # Outside the keys and the body limit: a browser page of another origin is refused before its
    # key is looked at or any of its body read.
    loopback = _is_loopback(settings.host)
    app.add_middleware(SameOrigin, allowed=settings.allowed_origin_set, loopback=loopback)
    app.add_middleware(TraceRequests)
    # The document lists every route's statuses and vLLM's request bodies (openapi_docs.py).
    openapi_docs.install(app, api_keys=keyed, loopback=loopback)
    return app


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: only localhost is known to stay on this machine
        return host == "localhost"
