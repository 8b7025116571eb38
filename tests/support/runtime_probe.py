"""``python -m support.runtime_probe <scenario>``: a service made of nothing but the shared runtime
(loopline.common.runtime.service), its loops chosen to end, raise, return early, ignore the stop or hold
the event loop, for tests/common/test_runtime.py and test_metrics.py. Run with ``PYTHONPATH``
holding tests/ and ``LOOPLINE_NATS_URL`` set.

It reports on loopline-runtime-probe (status on svc.runtime_probe.status) and logs what it does
("probe: ..."), so a test reads from the log what ran.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

from loopline.common.config.settings import CommonSettings
from loopline.common.runtime import service as runtime

log = logging.getLogger("probe")

SERVICE = "loopline-runtime-probe"
STATUS_SUBJECT = "svc.runtime_probe.status"
# Small, so the test of a loop that ignores the stop waits half a second, not ten.
GRACE_S = 0.5


async def until_stopped(rt: runtime.Runtime, name: str) -> None:
    """A well-behaved loop: it returns once the service is told to stop."""
    await rt.stopping.wait()
    log.info("probe: %s saw the stop", name)


async def raises(message: str, after_s: float = 0.3) -> None:
    await asyncio.sleep(after_s)
    raise RuntimeError(message)


async def returns_early() -> None:
    await asyncio.sleep(0.3)


async def ignores_stop(rt: runtime.Runtime) -> None:
    try:
        # Invariant: none; this loop is the bug the runtime must survive.
        while True:  # noqa: ASYNC110 - a loop that ignores the stop on purpose
            await asyncio.sleep(0.05)
    except asyncio.CancelledError:
        log.info("probe: stubborn cancelled (stopping %s)", rt.stopping.is_set())
        raise


async def blocks_the_event_loop(rt: runtime.Runtime, seconds: float = 5.0) -> None:
    """A loop that holds the event loop (a synchronous call where an await belonged), then behaves."""
    await asyncio.sleep(0.1)
    log.info("probe: blocking the event loop")
    time.sleep(seconds)  # noqa: ASYNC251 - the bug a scrape must survive
    log.info("probe: event loop free again")
    await rt.stopping.wait()


async def raises_on_stop(rt: runtime.Runtime) -> None:
    await rt.stopping.wait()
    raise RuntimeError("failed while stopping")


SCENARIOS = {
    "stop": lambda rt: {"first": until_stopped(rt, "first"), "second": until_stopped(rt, "second")},
    "raise": lambda rt: {"steady": until_stopped(rt, "steady"), "doomed": raises("doomed loop failed")},
    "return": lambda rt: {"steady": until_stopped(rt, "steady"), "quitter": returns_early()},
    "ignore": lambda rt: {"steady": until_stopped(rt, "steady"), "stubborn": ignores_stop(rt)},
    "raise-on-stop": lambda rt: {"steady": until_stopped(rt, "steady"), "clumsy": raises_on_stop(rt)},
    "block": lambda rt: {"steady": until_stopped(rt, "steady"), "hog": blocks_the_event_loop(rt)},
}


async def run(rt: runtime.Runtime, settings: CommonSettings) -> None:
    scenario = sys.argv[1]
    rt.on_stop(lambda: log.info("probe: cleanup ran"))
    await rt.connect()
    await rt.add_service(SERVICE, STATUS_SUBJECT, description="runtime test probe",
                         status=lambda: {"scenario": scenario})
    if scenario == "start-fails":
        raise ValueError("start-up failed on purpose")
    if scenario == "start-refused":
        raise runtime.StartRefused("found engine 9.9, tested with 1.0 only: install 1.0")
    if scenario == "slow-start":
        log.info("probe: loading for a minute")
        await asyncio.sleep(60)
        log.info("probe: loaded")
        scenario = "stop"
    await rt.serve(SCENARIOS[scenario](rt))


if __name__ == "__main__":
    runtime.main("probe", CommonSettings, run, grace_s=GRACE_S)
