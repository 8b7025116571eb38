"""Deleting a job retires its adapter everywhere, on a whole stack (tiny model, local launcher): a
short LoRA job is trained with the unmodified ``scalarlm`` client and served by job hash; once it is
deleted, /v1/models no longer lists it, a request naming it is a 404 that says it was deleted, the
replica has unloaded it (svc.inference.status), and neither CHECKPOINTS nor the ``adapters`` object
store holds anything of it.
"""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest
import scalarlm
from e2e.test_adapter_serving import PAIRS, announce, complete, wait_for
from nats.js.object_store import OBJ_ALL_META_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import ServiceStatus
from loopline.common.runtime import adapter_retire, bus
from loopline.ml.train.checkpoint import latest_checkpoint

RECIPE = {"max_steps": 6, "learning_rate": 1e-2, "batch_size": 3, "gradient_accumulation_steps": 1,
          "steps_per_checkpoint": 3, "adapter_type": "lora"}


@pytest.fixture(scope="module")
def retire_stack(tinker_stack):
    """The session's stack with local jobs reconciled often (conftest.py): retiring one job's
    adapter leaves the stack as it was for the others."""
    return tinker_stack


def held(stack, job: str) -> dict:
    """What NATS and the replica hold of ``job``: its checkpoint subjects, its adapter objects, and
    whether the replica reports it loaded."""
    async def go() -> dict:
        nc = await bus.connect(stack.nats_url, "test-retire")
        try:
            js = nc.jetstream()
            checkpoints = await js.stream_info(subjects.CHECKPOINTS_STREAM,
                                               subjects_filter=subjects.checkpoints_of_job(job))
            meta_all = OBJ_ALL_META_PRE_TEMPLATE.format(bucket=subjects.ADAPTERS_BUCKET)
            objects = await js.stream_info(OBJ_STREAM_TEMPLATE.format(bucket=subjects.ADAPTERS_BUCKET),
                                           subjects_filter=meta_all)
            names = [base64.urlsafe_b64decode(s[len(meta_all) - 1:]).decode()
                     for s in objects.state.subjects or {}]
            reply = await nc.request(subjects.SVC_INFERENCE_STATUS, b"{}", timeout=10)
            status = ServiceStatus.model_validate_json(reply.data)
            return {"checkpoints": list(checkpoints.state.subjects or {}),
                    "objects": [n for n in names if n.startswith(adapter_retire.adapter_objects_prefix(job))],
                    "loaded": job in status.detail.get("adapters", {})}
        finally:
            await nc.close()

    return asyncio.run(go())


def test_a_deleted_job_is_unlisted_refused_unloaded_and_purged(retire_stack, tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the client ships ./ml as user code: run it from an empty folder
    llm = scalarlm.SupermassiveIntelligence(api_url=retire_stack.url)
    job = llm.train([{"input": q, "output": a} for q, a in PAIRS], model_name=tiny,
                    train_args=RECIPE)["job_status"]["model_name"]
    wait_for(lambda: llm.get_training_job(job)["job_status"]["status"] == "COMPLETED", 240, 0.5)
    _, checkpoint = latest_checkpoint(retire_stack.jobs_dir / job)
    announce(retire_stack, checkpoint, job, tiny)  # as the stack's watcher does (see test_adapter_serving)
    with httpx.Client(base_url=retire_stack.url, timeout=120) as http:
        wait_for(lambda: http.get(f"/v1/megatron/train/{job}").json()["deployed"], 60)
        assert complete(http, job, PAIRS[0][0]).status_code == 200
        assert job in {m["id"] for m in http.get("/v1/models").json()["data"]}
        before = held(retire_stack, job)
        assert before["checkpoints"] and before["objects"] and before["loaded"], before

        deleted = http.post(f"/v1/megatron/delete/{job}")
        assert deleted.status_code == 200, deleted.text

        assert job not in {m["id"] for m in http.get("/v1/models").json()["data"]}
        refused = wait_for(lambda: (r := complete(http, job, PAIRS[0][0])).status_code == 404 and r, 30)
        assert "deleted" in refused.json()["error"]["message"]
        wait_for(lambda: not held(retire_stack, job)["loaded"], 30, 0.2)
        assert held(retire_stack, job) == {"checkpoints": [], "objects": [], "loaded": False}
        # The trainer forgot it, and the base model is still served beside.
        assert http.get(f"/v1/megatron/train/{job}").status_code == 404
        assert complete(http, tiny, PAIRS[0][0]).status_code == 200
