"""One tenant's events cannot flood the others' dashboard, nor its stream slots (issue: "no tenant
can hurt another", item 5): a real gateway process on a real nats-server, nothing else (no trainer:
its listing answers 503 at once, which is a listing all the same).

- Live pages coalesce: however many events arrive and pages are open, the gateway lists every job
  and run at most once per LOOPLINE_UI_EVENT_REFRESH_S (``loopline_gateway_ui_relists_total``),
  and every page is still brought up to date with the newest event.
- Run metrics are rate-limited per client address without keys (LOOPLINE_RUN_METRICS_PER_MINUTE):
  429 with ``Retry-After``, nothing published for a refused post.
- Live pages hold stream slots (LOOPLINE_MAX_STREAMS_PER_KEY), and a browser page of another site
  cannot take any.
- A run page reads its worker's events from its run's creation on, not another tenant's before.
- The per-client quota tables stay bounded whatever number of addresses asks (in-process).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import tracemalloc

import httpx
import pytest
from starlette.requests import Request

from loopline.common.contracts import subjects
from loopline.common.contracts.tinker_schemas import SessionEvent
from loopline.common.local import launcher
from loopline.common.runtime import bus
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.limits import RateQuota, WindowQuota
from loopline.gateway.ui.views import RunHistory
from support import tinker_records as records
from support.browser import Browser, other_site, require_chromium
from support.gateway_process import start_gateway
from support.scrape import scrape, value
from support.tinker_records import TinkerBus

PAGES = 6  # live pages open at once: all of the address's stream slots
EVENT_REFRESH_S = 0.5
FLOOD_S = 3.0
METRICS_PER_MINUTE = 60  # bursts of 6, then one a second
EVIL = "evil.example"


@pytest.fixture(scope="module")
def gateway(nats_proc, tmp_path_factory):
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("floods"),
                       LOOPLINE_MAX_STREAMS_PER_KEY=str(PAGES), LOOPLINE_UI_REFRESH_S="2",
                       LOOPLINE_UI_EVENT_REFRESH_S=str(EVENT_REFRESH_S),
                       LOOPLINE_RUN_METRICS_PER_MINUTE=str(METRICS_PER_MINUTE))
    yield gw
    launcher.stop(gw.proc)


@pytest.fixture(scope="module")
def tinker(nats_proc, gateway) -> TinkerBus:
    return TinkerBus(nats_proc.info["url"], "event-floods-test")


class LivePages(threading.Thread):
    """``count`` open ``/ui/live`` overviews, as browsers' EventSources hold them, all from the
    client address ``source`` (the holder of their stream slots without keys): the time of each
    page's ``sections`` messages and the newest event sequence its events section showed."""

    def __init__(self, url: str, count: int, source: str):
        super().__init__(daemon=True)
        self.url, self.count, self.source = url, count, source
        self.opened = threading.Barrier(count + 1, timeout=10)
        self.updates: list[list[float]] = [[] for _ in range(count)]
        self.newest_seq = [0] * count
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None

    def __enter__(self) -> LivePages:
        self.start()
        self.opened.wait()  # broken (an error) unless every page opened
        return self

    def __exit__(self, *_exc) -> None:
        assert self._loop is not None and self._stopped is not None
        self._loop.call_soon_threadsafe(self._stopped.set)
        self.join(10)

    def run(self) -> None:
        asyncio.run(self._all())

    async def _all(self) -> None:
        self._loop, self._stopped = asyncio.get_running_loop(), asyncio.Event()
        transport = httpx.AsyncHTTPTransport(local_address=self.source)
        async with httpx.AsyncClient(transport=transport, base_url=self.url, timeout=30) as client:
            pages = [asyncio.create_task(self._page(client, i)) for i in range(self.count)]
            await self._stopped.wait()
            for page in pages:
                page.cancel()
            await asyncio.gather(*pages, return_exceptions=True)

    async def _page(self, client: httpx.AsyncClient, i: int) -> None:
        async with client.stream("GET", "/ui/live", params={"page": "overview"}) as resp:
            if resp.status_code != 200:
                self.opened.abort()
                return
            await asyncio.to_thread(self.opened.wait)
            async for line in resp.aiter_lines():
                if line.startswith("event: sections"):
                    self.updates[i].append(time.monotonic())
                elif line.startswith("data: ") and self.updates[i]:
                    seqs = map(int, re.findall(r'data-seq=\\"(\d+)', line))
                    self.newest_seq[i] = max(self.newest_seq[i], *seqs, 0)


def relists(gateway) -> float:
    return value(scrape(f"{gateway.url}/metrics"), "loopline_gateway_ui_relists_total") or 0.0


def flood(nats_url: str, worker: str, seconds: float) -> tuple[int, int]:
    """Publish metrics events as fast as NATS takes them, 50 at a time, for ``seconds``; how many,
    and the sequence of the last."""
    async def go() -> tuple[int, int]:
        nc = await bus.connect(nats_url, "flooder")
        js, count, last = nc.jetstream(), 0, 0
        event = SessionEvent(worker_id=worker, kind="metrics", metrics={"reward": 1.0})
        body = event.model_dump_json().encode()
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                acks = await asyncio.gather(*(js.publish(subjects.session_event(worker, "metrics"), body)
                                              for _ in range(50)))
                count, last = count + len(acks), max(a.seq for a in acks)
                await asyncio.sleep(0.01)
        finally:
            await nc.close()
        return count, last

    return asyncio.run(go())


def test_live_pages_share_one_listing_per_interval_whatever_the_event_rate(gateway, nats_proc):
    """Before: each open page re-listed every job and run at each event, up to 5 times a second.
    Now one listing per interval for them all."""
    with LivePages(gateway.url, PAGES, "127.0.0.2") as pages:
        time.sleep(1.0)  # the first renderings done
        before, started = relists(gateway), time.monotonic()
        events, last_seq = flood(nats_proc.info["url"], "flood-worker", FLOOD_S)
        time.sleep(EVENT_REFRESH_S * 3)  # the listing after the last event, and its pages' pass
        listed, elapsed = relists(gateway) - before, time.monotonic() - started
        print(f"{events} events in {FLOOD_S} s, {PAGES} pages: {listed:g} listings in {elapsed:.1f} s, "
              f"updates per page {[len(u) for u in pages.updates]}")
        assert events > 500, f"only {events} events published: not a flood"
        assert listed <= elapsed / EVENT_REFRESH_S + 2, f"{listed} listings in {elapsed:.1f} s"
        for updates, newest in zip(pages.updates, pages.newest_seq, strict=True):
            during = [t for t in updates if started <= t <= started + elapsed]
            assert 2 <= len(during) <= elapsed / EVENT_REFRESH_S + 2, (len(during), elapsed)
            assert newest == last_seq, "a page did not show the newest event"


def test_live_pages_hold_stream_slots_and_other_sites_get_none(gateway):
    """A live page is an event stream of its client's (LOOPLINE_MAX_STREAMS_PER_KEY); before, a
    page of any site the user visited could take every slot with GETs (they pass the same-origin
    check on a loopback Host) and lock the user's own dashboard out. Now: 403 before a slot."""
    cross_site = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site",
                  "Sec-Fetch-Mode": "cors", "Accept": "text/event-stream"}
    source = "127.0.0.3"
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), base_url=gateway.url,
                      timeout=10) as http:
        statuses = []
        for _ in range(PAGES + 1):
            with http.stream("GET", "/ui/live", params={"page": "overview"}, headers=cross_site) as resp:
                statuses.append(resp.status_code)
                why = resp.read().decode() if resp.status_code != 200 else ""
        assert statuses == [403] * (PAGES + 1), statuses
        assert "LOOPLINE_ALLOWED_ORIGINS" in why
        with LivePages(gateway.url, PAGES, source):  # the user's own: all open still
            one_more = http.get("/ui/live", params={"page": "overview"})
            assert one_more.status_code == 429, one_more.text
            assert "LOOPLINE_MAX_STREAMS_PER_KEY" in one_more.text and source in one_more.text


# Tier: Chromium, ~5 s.
@pytest.mark.slow
def test_a_real_browser_page_of_another_site_takes_no_stream_slot(gateway, tmp_path):
    """The attack itself: a page of evil.example, open in the user's browser, opens more
    EventSources to the gateway than the user has slots. Each is refused (403, counted by the
    gateway), and the user's own pages, from the same address, still get every slot."""
    require_chromium()

    def refused() -> float:
        return value(scrape(f"{gateway.url}/metrics"), "loopline_gateway_requests_total", route="/ui/live",
                     method="GET", status="403") or 0.0

    before = refused()
    with other_site(EVIL) as evil, Browser(tmp_path / "browser", resolve={EVIL: "127.0.0.1"}) as browser:
        evil.html = (f"<script>window.streams = Array.from({{length: {PAGES + 2}}}, () => new EventSource("
                     f"{gateway.url!r} + '/ui/live?page=overview'));</script>").encode()
        page = browser.page()
        page.open(evil.url)
        page.wait_for("window.streams.every(s => s.readyState === EventSource.CLOSED)")
        assert refused() - before == PAGES + 2
        with LivePages(gateway.url, PAGES, "127.0.0.1"):  # while the page of evil.example is open
            pass


def test_run_metrics_are_rate_limited_per_client_without_keys(gateway, tinker, nats_proc):
    """Before: without keys, any client could post metrics as fast as it liked, each an EVENTS
    message every open page heard. Now a burst of a tenth of LOOPLINE_RUN_METRICS_PER_MINUTE, then
    429 with Retry-After (nothing published), then one more per 60/limit seconds."""
    s, w = records.session(), records.worker()
    run = records.model(s, w)
    tinker.put(s, w, run)
    burst = METRICS_PER_MINUTE // 10
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        posted = [http.post(f"/v1/tinker/runs/{run.model_id}/metrics", json={"metrics": {"reward": i}})
                  for i in range(burst + 1)]
        assert [r.status_code for r in posted] == [200] * burst + [429], posted[-1].text
        assert "LOOPLINE_RUN_METRICS_PER_MINUTE" in posted[-1].text
        assert 1 <= int(posted[-1].headers["retry-after"]) <= 60 // METRICS_PER_MINUTE
        time.sleep(60 / METRICS_PER_MINUTE)
        again = http.post(f"/v1/tinker/runs/{run.model_id}/metrics", json={"metrics": {"reward": 9}})
        assert again.status_code == 200, again.text

    async def stored(nc) -> int:
        info = await nc.jetstream().stream_info(
            subjects.EVENTS_STREAM, subjects_filter=subjects.session_event(w.worker_id, "metrics"))
        return sum((info.state.subjects or {}).values())

    assert tinker.ask(stored) == burst + 1


async def test_a_run_page_does_not_replay_its_workers_history_before_the_run(gateway, tinker, nats_proc):
    """A worker serves every key's runs of its base model. Before: a run's page read the worker's
    whole history, another tenant's earlier run's thousands of events included, to draw its own
    few. Now it reads from shortly before its run was created (here 1 s; 60 s by default)."""
    s, w = records.session(owner="b"), records.worker()
    earlier = records.model(s, w, 0, owner="b")
    nc = await bus.connect(nats_proc.info["url"], "run-history-test")
    try:
        js = nc.jetstream()

        async def publish(event: SessionEvent):
            return await js.publish(subjects.session_event(w.worker_id, event.kind),
                                    event.model_dump_json().encode())

        await asyncio.gather(*(publish(SessionEvent(worker_id=w.worker_id, kind="metrics", step=n,
                                                    model_id=earlier.model_id, metrics={"reward": 0.0}))
                               for n in range(3000)))
        await asyncio.sleep(1.5)
        own = records.model(records.session(owner="a"), w, 0, owner="a")
        for n in range(1, 6):
            await publish(SessionEvent(worker_id=w.worker_id, kind="step", model_id=own.model_id, step=n,
                                       loss=1.0 / n))
        history = RunHistory(own, clock_skew_s=1.0)
        try:
            await history.catch_up(js)
            read = (await history._sub.consumer_info()).delivered.consumer_seq
        finally:
            await history.close()
    finally:
        await nc.close()
    assert history.steps == 5 and [p[0] for p in history.loss.points] == [1, 2, 3, 4, 5]
    assert read == 5, f"the page read {read} events to draw 5"


def _request(address: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/", "headers": [], "client": (address, 1),
                    "app": None, "state": {}})


@pytest.mark.parametrize("quota", [
    lambda: WindowQuota(10, 3600, "max_tinker_sessions_per_key", "sessions", max_holders=1000),
    lambda: RateQuota(60, "run_metrics_per_minute", "posts", max_holders=1000)])
def test_per_client_tables_stay_bounded_whatever_the_number_of_addresses(quota):
    """Before: one entry per client address ever seen, kept forever (20,000 addresses: ~5 MB).
    Now the least recently seen are forgotten past the bound; a holder seen lately keeps its count."""
    table = quota()
    tracemalloc.start()
    try:
        for i in range(20_000):
            table.take(_request(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    entries = table.times if isinstance(table, WindowQuota) else table.buckets
    assert len(entries) == 1000
    assert peak < 2 * 1024 * 1024, peak
    recent = _request("10.0.78.31")  # one of the last 1000 seen: its count is kept
    with pytest.raises(ApiError) as refused:
        for _ in range(11):
            table.take(recent)
    assert refused.value.status == 429
