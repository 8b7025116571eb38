"""The one way a Loopline service process starts, runs and stops.

Every service's ``__main__`` is one line, ``runtime.main(ROLE, TheSettings, run)``, and its
``run(rt, settings)`` reads as a short numbered list of steps that ends in
``await rt.serve({"name": loop(), ...})``. What used to be copied into each service lives here:
the replica id, logging, tracing, the Prometheus ``/metrics`` server (metrics.py), the NATS
connection, signal handling, the ``$SRV`` service with its ``status`` endpoint, the policy for loops
that die, and the drain at the end.

Exit policy (the supervisor — ``make up``, compose, Kubernetes — restarts a process that exits
non-zero, so a process that cannot do its job must exit rather than limp on):

    SIGTERM / SIGINT             the $SRV service stops answering, loops get ``grace_s`` to finish
                                 the step they are in, cleanups run, NATS drains: exit 0
    a loop raises or returns     its traceback is logged, the other loops are stopped as above:
    before it was told to stop   exit 1
    start-up raises              its traceback is logged, cleanups run: exit 1
    start-up raises StartRefused its message alone is logged (the process cannot work as installed
                                 or configured; a traceback would bury the why), cleanups run: exit 2

A signal during start-up (a model still loading) cancels start-up: the process does not first
finish a minute of loading only to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextlib import AsyncExitStack
from typing import Any, NoReturn, TypeVar

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import Service

from loopline.common.config.settings import CommonSettings
from loopline.common.contracts.schemas import ServiceStatus
from loopline.common.runtime import bus, metrics
from loopline.common.runtime.telemetry import setup_tracing

log = logging.getLogger(__name__)

VERSION = "0.1.0"
# After SIGTERM a loop gets this long to finish the step it is in (a fetch waits at most ~2 s, an
# inference replica finishes its in-flight requests) before it is cancelled. Kubernetes' default
# grace period is 30 s: the whole stop, drain included, fits well inside it.
GRACE_S = 10.0
# The longest the final NATS drain may wait for subscriptions' queued messages to be handled (it
# flushes pending publishes and acks, and closes, either way). A callback subscription handles its
# queue in milliseconds; a pull subscription whose loop has ended, or died, never reads what is
# still queued for it (a late message, its pull's expiry notice), and nats-py's own default, 30 s,
# held a stopping queue service and replica that long: Kubernetes' whole grace period.
DRAIN_TIMEOUT_S = 3
# A loop that dies is a bug or a lost dependency: the process exits with this status.
EXIT_LOOP_DIED = 1
EXIT_START_FAILED = 1
# Distinct from a failure, so a supervisor's log or a test can tell "will not work as installed"
# from "broke": restarting does not help.
EXIT_START_REFUSED = 2

S = TypeVar("S", bound=CommonSettings)
Cleanup = Callable[[], Any]  # sync, or returning an awaitable
StatusDetail = Callable[[], "dict[str, Any] | Awaitable[dict[str, Any]]"]


class LoopDied(Exception):
    """A loop ended before the service was told to stop."""


class StartRefused(Exception):
    """Raised by start-up when this process cannot do its job as installed or configured (an
    engine version it is not tested with...): its message must say what was found, what is wanted
    and what to do, since it is all the runtime logs."""


class Runtime:
    """What one service process owns besides its own work: see the module docstring."""

    def __init__(self, role: str, settings: CommonSettings, *, grace_s: float = GRACE_S):
        self.role = role
        self.settings = settings
        self.replica = settings.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.grace_s = grace_s
        # Set by SIGTERM/SIGINT, or when a loop dies: every loop ends soon after it is set.
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.service: Service | None = None
        self._cleanups = AsyncExitStack()
        self._serving = False
        self._startup: asyncio.Task | None = None
        self.metrics: metrics.MetricsServer | None = None

    # --- start-up -----------------------------------------------------------------------------------
    async def connect(self, *, topology: bool = True) -> tuple[NATS, JetStreamContext]:
        """Connect to NATS (reconnecting forever) and make sure every stream and bucket exists.
        The connection drains last, after every other cleanup: pending publishes and acks go out."""
        self.nc = await bus.connect(self.settings.nats_url, f"{self.role}-{self.replica}")
        self.nc.options["drain_timeout"] = DRAIN_TIMEOUT_S  # read by nc.drain(), at the very end
        self._cleanups.push_async_callback(self._drain_nats)
        self.js = self.nc.jetstream()
        if topology:
            await bus.ensure_topology(self.js, retention=bus.Retention.of(self.settings))
        return self.nc, self.js

    async def add_service(self, name: str, status_subject: str, *, description: str,
                          status: StatusDetail, metadata: Mapping[str, str] | None = None) -> Service:
        """Register this process as an instance of the nats.micro service ``name`` ($SRV.PING,
        INFO, STATS) with a ``status`` endpoint answering a ServiceStatus whose ``detail`` is
        ``status()`` plus ``metrics_url`` (where this process serves ``/metrics``, when it does; the
        service's INFO metadata has it as ``metrics``). Add the service's own endpoints to what this
        returns. It stops answering as soon as the process is told to stop, before its loops finish."""
        if self.nc is None:
            raise RuntimeError("connect() before add_service()")
        metrics_url = {"metrics_url": self.metrics.url} if self.metrics else {}

        async def answer_status(req: Request) -> None:
            detail = status()
            if isinstance(detail, Awaitable):
                detail = await detail
            reply = ServiceStatus(service=self.role, replica=self.replica, detail={**detail, **metrics_url})
            await req.respond(reply.model_dump_json().encode())

        def stats_data(_endpoint: object) -> dict[str, Any] | None:
            # $SRV.STATS reaches every instance (an endpoint reaches one of a queue group): the
            # dashboard reads each replica's status there in one request (gateway ui/cluster_feed.py).
            detail = status()
            if isinstance(detail, Awaitable):  # an async status is for the endpoint only
                if isinstance(detail, Coroutine):
                    detail.close()
                return None
            return ServiceStatus(service=self.role, replica=self.replica, detail=detail).model_dump()

        self.service = await add_service(
            self.nc, name=name, version=VERSION, description=description, stats_handler=stats_data,
            metadata={"replica": self.replica, **(metadata or {}),
                      **({"metrics": self.metrics.url} if self.metrics else {})})
        await self.service.add_endpoint(name="status", subject=status_subject, handler=answer_status)
        self._cleanups.push_async_callback(self._stop_service)
        return self.service

    def on_stop(self, cleanup: Cleanup) -> None:
        """Run ``cleanup`` at the end, after the loops and before NATS drains; cleanups run in the
        reverse order of registration (the last resource opened is the first closed)."""
        async def run() -> None:
            result = cleanup()
            if isinstance(result, Awaitable):
                await result

        self._cleanups.push_async_callback(run)

    # --- the loops ----------------------------------------------------------------------------------
    async def serve(self, loops: Mapping[str, Awaitable[None]]) -> None:
        """Run the service's named loops until the process is told to stop or one of them dies.

        Each loop runs until ``self.stopping`` is set and then returns within ``grace_s``. A loop
        that raises, or returns while ``stopping`` is not set, has died: its traceback is logged,
        every other loop is stopped, and the process will exit with EXIT_LOOP_DIED.
        """
        # Imports, models and connections leave a heap that lives as long as the process; frozen
        # out of the collector's way, a full collection no longer walks it (it paused the gateway
        # for ~30 ms and a replica at p90 latency in the serving benchmark).
        gc.collect()
        gc.freeze()
        self._serving = True
        tasks = {asyncio.create_task(_named(coro), name=name): name for name, coro in loops.items()}
        stop = asyncio.create_task(self.stopping.wait())
        log.info("%s %s serving: loops %s", self.role, self.replica, ", ".join(loops))
        try:
            # Invariant: while no loop has ended and no signal came, every loop is running; the
            # first loop to end, or the signal, starts the stop of all of them.
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in tasks.keys() & done:  # the loops that ended (the signal is not one)
                self._loop_ended(tasks[task], task, during_stop=self.stopping.is_set())
            self.stopping.set()
            await self._stop_service()
            _, late = await asyncio.wait(tasks, timeout=self.grace_s) if tasks else (set(), set())
            for task in late:
                log.warning("loop %s did not stop within %.0f s: cancelled", tasks[task], self.grace_s)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for task in tasks.keys() - done:
                if not task.cancelled() and task.exception() is not None:
                    self._loop_ended(tasks[task], task, during_stop=True)
        finally:
            stop.cancel()
            for task in tasks:
                task.cancel()

    def _loop_ended(self, name: str, task: asyncio.Task, *, during_stop: bool) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is None and during_stop:
            return  # it saw the stop and returned: that is how a loop ends
        self.exit_code = EXIT_LOOP_DIED
        if exc is None:
            exc = LoopDied(f"loop {name!r} was cancelled" if task.cancelled()
                           else f"loop {name!r} returned before the service was told to stop")
        log.error("loop %s died; stopping %s %s (exit %d) so its supervisor restarts it", name,
                  self.role, self.replica, EXIT_LOOP_DIED, exc_info=exc)

    # --- stopping -----------------------------------------------------------------------------------
    def _on_signal(self, signum: int) -> None:
        if self.stopping.is_set() and signum == signal.SIGINT:
            log.warning("second interrupt: exiting without waiting for the loops")
            os._exit(130)
        log.info("%s %s: %s received, stopping", self.role, self.replica, signal.Signals(signum).name)
        self.stopping.set()
        if not self._serving and self._startup is not None:
            self._startup.cancel()  # still starting: there is nothing to finish

    async def _stop_service(self) -> None:
        service, self.service = self.service, None
        if service is not None:
            with contextlib.suppress(Exception):  # the connection may be gone already
                await service.stop()

    async def _drain_nats(self) -> None:
        if self.nc is None or self.nc.is_closed:
            return
        try:
            await self.nc.drain()
        except Exception as exc:  # noqa: BLE001 - already closed by a failed reconnect
            log.debug("drain: %s", exc)

    def _serve_metrics(self) -> None:
        """Serve ``/metrics`` from the first moment, so a replica still loading its model can be
        scraped too; the server closes last, after NATS has drained."""
        metrics.SERVICE.info({"role": self.role, "replica": self.replica, "version": VERSION})
        self.metrics = metrics.serve_metrics(self.settings.metrics_port)
        if self.metrics is None:
            log.info("%s %s: metrics off", self.role, self.replica)
            return
        self._cleanups.push_async_callback(asyncio.to_thread, self.metrics.close)
        log.info("%s %s: metrics at %s", self.role, self.replica, self.metrics.url)

    async def _start(self, body: Callable[[Runtime], Awaitable[None]]) -> None:
        self._serve_metrics()
        await body(self)

    async def run(self, body: Callable[[Runtime], Awaitable[None]]) -> int:
        """Run ``body`` (the service's start-up steps, ending in ``serve``); returns the exit status."""
        setup_tracing(f"loopline-{self.role}", self.settings.otlp_endpoint)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
        self._startup = asyncio.create_task(self._start(body), name=f"{self.role}-run")
        try:
            await self._startup
        except asyncio.CancelledError:
            if not self.stopping.is_set():
                raise
            log.info("%s %s: stopped during start-up", self.role, self.replica)
        except StartRefused as exc:
            log.error("%s %s refuses to start: %s; exiting %d", self.role, self.replica, exc,
                      EXIT_START_REFUSED)
            self.exit_code = EXIT_START_REFUSED
        except Exception:
            log.exception("%s %s failed to start; exiting %d", self.role, self.replica, EXIT_START_FAILED)
            self.exit_code = EXIT_START_FAILED
        finally:
            try:
                await self._cleanups.aclose()
            except Exception:
                log.exception("%s %s: a cleanup failed", self.role, self.replica)
                self.exit_code = self.exit_code or 1
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
        log.info("%s %s stopped (exit %d)", self.role, self.replica, self.exit_code)
        return self.exit_code


async def pause(stopping: asyncio.Event, seconds: float) -> bool:
    """A loop's wait between passes: ``seconds``, cut short when ``stopping`` is set. True when the
    loop should end."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), timeout=seconds)
    return stopping.is_set()


async def _named(awaitable: Awaitable[None]) -> None:
    await awaitable


# --- the process ------------------------------------------------------------------------------------
def setup_logging(role: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run_event_loop(main: Awaitable[int]) -> int:
    """Run ``main`` on uvloop where it is installed (every Loopline image installs it): on a small
    machine the gateway, NATS, the queue and a replica share the cores the engine leaves, and
    uvloop spends less of them per message and per socket than asyncio's pure-Python loop."""
    async def wrapped() -> int:
        return await main

    try:
        import uvloop
    except ImportError:  # Windows, or an install without it: asyncio's loop works the same
        return asyncio.run(wrapped())
    return uvloop.run(wrapped())


def main(role: str, settings_type: type[S], run: Callable[[Runtime, S], Awaitable[None]], *,
         grace_s: float = GRACE_S) -> NoReturn:
    """A service's ``python -m`` entry point: settings from ``LOOPLINE_*``, logging, then ``run``
    under the runtime; the process exits with the runtime's exit status."""
    settings = settings_type()
    setup_logging(role, settings.log_level)

    async def body() -> int:
        rt = Runtime(role, settings, grace_s=grace_s)
        return await rt.run(lambda rt: run(rt, settings))

    sys.exit(run_event_loop(body()))
