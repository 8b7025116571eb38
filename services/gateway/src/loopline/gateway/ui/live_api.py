"""``/ui/live``: one server-sent event stream per open dashboard page. It renders the page's
sections again at each of the gateway's listings of jobs and runs (ui/listings.py: soon after an
event on EVENTS, a step, a checkpoint, an adapter loaded, at most once per
``LOOPLINE_UI_EVENT_REFRESH_S`` and at least every ``LOOPLINE_UI_REFRESH_S``), and sends the ones
that changed as one ``sections`` message (``{"<section id>": "<html>"}``); live.js puts them in
place.

It holds a stream slot of the key's (``@held_stream``, as every event stream), so a page cannot
open connections without bound; the browser's EventSource reconnects by itself after a cut.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from prometheus_client import Gauge

from loopline.gateway.auth.scopes import ANY_KEY, TRAINING
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.event_streams import KEEPALIVE_S, SSE_HEADERS, held_stream
from loopline.gateway.core.route_spec import EVENT_STREAM, FIELDS, STREAMS, declare
from loopline.gateway.gateway import Gateway, gateway_of
from loopline.gateway.ui.pages import JobPage, Overview, Page, RunPage
from loopline.gateway.ui.views import Viewer

router = APIRouter(prefix="/ui")
log = logging.getLogger(__name__)

LIVE_PAGES = Gauge("loopline_gateway_live_pages", (
    "Dashboard pages following this gateway now (one event stream each, /ui/live)."))
# How long the browser waits before it reconnects a cut stream.
RETRY_MS = 3000


@router.get("/live", **declare(ANY_KEY, {403: "a job or run page needs the training scope",
                                         404: "no such job or run", 422: FIELDS, 429: STREAMS},
                               media_type=EVENT_STREAM))
@held_stream
async def live(request: Request, page: str = Query(pattern="^(overview|job|run)$"),
               id: str = Query("", max_length=200)) -> StreamingResponse:
    gateway = gateway_of(request)
    state = await _page(gateway, Viewer.of(request), page, id)
    return StreamingResponse(_follow(gateway, state), media_type="text/event-stream", headers=SSE_HEADERS)


async def _page(gateway: Gateway, viewer: Viewer, page: str, ident: str) -> Page:
    if page == "overview":
        return Overview(gateway, viewer)
    if not viewer.can(TRAINING):
        raise ApiError(403, "a job or run page needs a key with the training scope", type="permission_error")
    if page == "job":
        return JobPage(gateway, viewer, await gateway.trainer.get(ident, viewer.tenant))
    return RunPage(gateway, viewer, await gateway.tinker.model(ident, viewer.tenant))


async def _follow(gateway: Gateway, state: Page) -> AsyncIterator[str]:
    feeds = gateway.ui
    listings = feeds.listings
    sent: dict[str, str] = {}
    quiet_since = time.monotonic()
    LIVE_PAGES.inc()
    # Invariant: after each pass the browser holds exactly ``sent``, the newest rendering of every
    # section; a pass starts at the gateway's next listing (ui/listings.py: at most one per
    # LOOPLINE_UI_EVENT_REFRESH_S, at least one per refresh_s, for all pages together).
    try:
        async with listings.viewing():
            version = listings.version
            yield f"retry: {RETRY_MS}\n\n"
            while True:
                try:
                    sections = await state.sections(listings.current())
                except Exception as exc:  # noqa: BLE001 - NATS or a service slow: say so, try again
                    log.info("a live page could not be brought up to date: %s", exc)
                    yield f"event: trouble\ndata: {json.dumps(_why(exc))}\n\n"
                    await asyncio.sleep(feeds.refresh_s)
                    continue
                changed = {name: html for name, html in sections.items() if sent.get(name) != html}
                if changed:
                    sent.update(changed)
                    quiet_since = time.monotonic()
                    yield f"event: sections\ndata: {json.dumps(changed)}\n\n"
                elif time.monotonic() - quiet_since >= KEEPALIVE_S:
                    quiet_since = time.monotonic()
                    yield ": keepalive\n\n"
                # Longer than refresh_s: the listing is due by then; a stuck one still lets the
                # page's own parts (a job's log, the cluster) move on.
                version = await listings.wait_past(version, 2 * feeds.refresh_s)
    finally:
        LIVE_PAGES.dec()
        await state.close()


def _why(exc: Exception) -> str:
    return f"not up to date: {getattr(exc, 'message', None) or exc or type(exc).__name__}; retrying"
