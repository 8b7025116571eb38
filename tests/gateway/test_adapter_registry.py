"""The gateway's view of adapter events: what is deployed, which job ``latest`` names, and why a
job is not servable. (Routing through it, end to end: tests/e2e/test_adapter_serving.py.)"""

from __future__ import annotations

import asyncio
import time

from loopline.common.contracts import subjects
from loopline.common.contracts.job_schemas import AdapterEvent
from loopline.common.local import launcher
from loopline.common.runtime import bus
from loopline.gateway.core.adapters import AdapterRegistry
from support.nats import nats_server, restart


def loaded(job: str, step: int, at: float, replica: str = "r0", base: str = "tiny") -> AdapterEvent:
    return AdapterEvent(job_hash=job, kind="loaded", step=step, time=at, replica=replica,
                        base_model=base, adapter_type="lora", latency_s=0.1, load_s=0.01)


def test_loaded_events_make_a_job_deployed_with_its_newest_step():
    registry = AdapterRegistry(js=None)
    registry.apply(loaded("a", 10, 1.0))
    registry.apply(loaded("a", 20, 2.0, replica="r1"))
    registry.apply(loaded("a", 10, 3.0, replica="r2"))  # a late replica catching up with an older one
    served = registry.served["a"]
    assert registry.deployed("a") and not registry.deployed("b")
    assert served.step == 20 and served.replicas == {"r0", "r1", "r2"} and served.first_loaded_at == 1.0


def test_latest_is_the_job_first_loaded_last_among_served_base_models():
    registry = AdapterRegistry(js=None)
    registry.apply(loaded("old", 10, 1.0))
    registry.apply(loaded("new", 10, 2.0))
    registry.apply(loaded("old", 20, 3.0))  # further training of an older job does not make it latest
    registry.apply(loaded("other-base", 10, 4.0, base="smollm"))
    assert registry.latest({"tiny"}).job_hash == "new"
    assert registry.latest({"tiny", "smollm"}).job_hash == "other-base"
    assert registry.latest({"absent"}) is None


def test_rejections_explain_until_a_later_checkpoint_loads():
    registry = AdapterRegistry(js=None)
    registry.apply(AdapterEvent(job_hash="a", kind="rejected", step=10, reason="full fine-tune",
                                replica="r0"))
    assert registry.rejected["a"] == "full fine-tune" and not registry.deployed("a")
    registry.apply(loaded("a", 20, 1.0))
    assert "a" not in registry.rejected and registry.deployed("a")
    registry.apply(AdapterEvent(job_hash="a", kind="rejected", step=5, reason="stale"))
    assert "a" not in registry.rejected  # older than what is served: nothing to explain


def test_a_retired_job_is_unlisted_explained_as_deleted_and_not_revived_by_a_late_load():
    registry = AdapterRegistry(js=None)
    written = 100.0
    registry.apply(loaded("a", 10, written + 1))
    registry.apply(AdapterEvent(job_hash="a", kind="retired", time=written + 5, reason="deleted"))
    assert not registry.deployed("a") and registry.latest({"tiny"}) is None
    assert "deleted" in registry.rejected["a"]
    # A replica that loaded a checkpoint written before the delete, heard after it.
    late = loaded("a", 20, written + 9)
    late.checkpoint_created_at = written + 2
    registry.apply(late)
    assert not registry.deployed("a")
    # The same hash submitted again: its checkpoints are written after the retirement.
    again = loaded("a", 10, written + 30)
    again.checkpoint_created_at = written + 20
    registry.apply(again)
    assert registry.deployed("a") and "a" not in registry.rejected


def test_events_published_after_a_nats_restart_still_reach_the_registry(tmp_path):
    """The registry follows EVENTS through an ephemeral ordered consumer, which a restarted
    nats-server no longer has; a job loaded after the restart must still be listed and be
    ``latest``, not only be found by the look-up on a miss."""

    async def served_within(registry: AdapterRegistry, job: str, timeout_s: float) -> float | None:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if job in registry.served:
                return time.monotonic() - start
            await asyncio.sleep(0.1)
        return None

    async def publish(js, event: AdapterEvent) -> None:
        await bus.publish_durable(js, subjects.adapter_event(event.job_hash, "loaded"),
                                  event.model_dump_json().encode(), msg_id=f"{event.job_hash}-{event.step}",
                                  deadline_s=30)

    async def scenario(procs: list):
        nc = await bus.connect(procs[0].info["url"], "test-gateway")
        js = nc.jetstream()
        await bus.ensure_topology(js)
        registry = AdapterRegistry(js)
        await registry.start()
        await publish(js, loaded("before", 10, time.time()))
        assert await served_within(registry, "before", 5) is not None

        procs.append(restart(procs[0], tmp_path))
        await publish(js, loaded("after", 10, time.time()))  # retried until the server is back
        # nats-py notices the lost consumer after two missed heartbeats (HEARTBEAT_S each) and
        # re-creates it from the next sequence. With its 5 s default this took about 18 s.
        waited = await served_within(registry, "after", 10)
        assert waited is not None, "the registry did not hear of a job loaded after the restart"
        print(f"heard of the job {waited:.1f} s after publishing it")
        assert registry.latest({"tiny"}).job_hash == "after"
        assert registry.served["before"].step == 10  # what it knew before the restart, it still knows
        await registry.stop()
        await nc.close()

    with nats_server(tmp_path) as first:
        procs = [first]
        try:
            asyncio.run(scenario(procs))
        finally:
            launcher.stop(procs[-1])  # the restarted server (the first is stopped by the restart)
