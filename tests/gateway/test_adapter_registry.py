"""The gateway's view of adapter events: what is deployed, which job ``latest`` names, and why a
job is not servable. (Routing through it, end to end: tests/e2e/test_adapter_serving.py.)"""

from __future__ import annotations

from loopline.common.job_schemas import AdapterEvent
from loopline.gateway.adapters import AdapterRegistry


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
