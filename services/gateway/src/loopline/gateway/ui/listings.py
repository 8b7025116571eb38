"""Every training job and Tinker run, listed once for all of a gateway's open dashboard pages; each
page shows the viewer's own of them (auth/tenancy.py).

While a live page is open (``viewing``), one task re-lists them at an event on EVENTS or every
``refresh_s``, but never sooner than ``min_interval_s`` after its last listing began, however many
events arrive and pages are open; each listing then wakes every live page (``wait_past``). Before,
each page re-listed at each event, up to five times a second: one tenant's flood of events made
every other tenant's pages, and the trainer, work in proportion to pages times events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import Counter

from loopline.common.contracts.job_schemas import JobInfo, JobList
from loopline.common.contracts.tinker_schemas import TinkerModel
from loopline.gateway.core.errors import ApiError
from loopline.gateway.ui.event_feed import EventFeed

log = logging.getLogger(__name__)

RELISTS = Counter("loopline_gateway_ui_relists", (
    "Listings of every training job and Tinker run for the dashboard: at most one per "
    "LOOPLINE_UI_EVENT_REFRESH_S for all of the gateway's open pages, whatever the event rate."))


@dataclass(frozen=True)
class Listing:
    began: float  # monotonic: when it was asked for
    jobs: list[JobInfo]  # newest first, every tenant's
    jobs_error: str | None
    runs: list[TinkerModel]  # every tenant's
    runs_error: str | None


class Listings:
    def __init__(self, list_jobs: Callable[[], Awaitable[JobList]],
                 list_runs: Callable[[], Awaitable[list[TinkerModel]]], events: EventFeed,
                 refresh_s: float, min_interval_s: float):
        self.list_jobs, self.list_runs, self.events = list_jobs, list_runs, events
        self.refresh_s = refresh_s
        self.min_interval_s = min(min_interval_s, refresh_s)
        self.latest: Listing | None = None
        self.version = 0  # one more per listing
        self.viewers = 0
        self._reading = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    async def fresh(self) -> Listing:
        """A listing begun after this call was; callers that wait for one in progress share the
        next one rather than each making their own."""
        asked = time.monotonic()
        async with self._reading:
            if self.latest is not None and self.latest.began >= asked:
                return self.latest
            listing = self.latest = await self._list()
        self.version += 1
        async with self._changed:
            self._changed.notify_all()
        return listing

    def current(self) -> Listing | None:
        """The newest listing, unless it is older than ``refresh_s`` (none was made while no page
        was open): a live page's, between two listings."""
        latest = self.latest
        if latest is None or time.monotonic() - latest.began > self.refresh_s + self.min_interval_s:
            return None
        return latest

    async def wait_past(self, version: int, timeout_s: float) -> int:
        """Wait until a listing newer than ``version`` is made or ``timeout_s`` have passed; the
        version then."""
        if self.version == version:
            with contextlib.suppress(TimeoutError):
                async with self._changed:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self.version != version), timeout_s)
        return self.version

    @contextlib.asynccontextmanager
    async def viewing(self) -> AsyncIterator[None]:
        """For as long as a live page is open: the re-listing task runs while any is."""
        self.viewers += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._refresh())
        try:
            yield
        finally:
            self.viewers -= 1
            if self.viewers == 0 and self._task is not None:
                self._task.cancel()
                self._task = None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _refresh(self) -> None:
        # Invariant: a listing begins within min_interval_s of every event heard since the one
        # before began, and at most one begins per min_interval_s.
        while True:
            seen = self.events.version
            began = time.monotonic()
            try:
                await self.fresh()
            except Exception:  # never the pages' end: they show the last one
                log.exception("the dashboard could not list the jobs and runs")
            await asyncio.sleep(max(0.0, began + self.min_interval_s - time.monotonic()))
            await self.events.wait_past(seen, max(0.0, began + self.refresh_s - time.monotonic()))

    async def _list(self) -> Listing:
        RELISTS.inc()
        began = time.monotonic()
        (jobs, jobs_error), (runs, runs_error) = await asyncio.gather(self._jobs(), self._runs())
        return Listing(began, jobs, jobs_error, runs, runs_error)

    async def _jobs(self) -> tuple[list[JobInfo], str | None]:
        try:
            return (await self.list_jobs()).jobs, None
        except ApiError as exc:
            return [], exc.message

    async def _runs(self) -> tuple[list[TinkerModel], str | None]:
        try:
            return await self.list_runs(), None
        except Exception as exc:  # noqa: BLE001 - NATS slow or down: the page says so
            return [], f"cannot read the Tinker runs: {exc}"
