"""A Tinker training client whose LoRA the served model cannot serve is refused when it is created.

The SDK trains the unembedding by default (``train_unembed=True``); vLLM serves a LoRA on ``lm_head``
only for some model classes, which the replica writes into its deployment record
(tests/inference/test_lora_targets.py; Qwen2, Mistral and Gemma 3 through Loopline's own hook, Gemma 2
not). Before, a client on such a model trained and then every sample failed with vLLM's 422; now
``create_model`` answers 400 naming ``train_unembed`` and the model class. Real parts: nats-server,
the gateway and the trainer as processes, the unmodified SDK; the replica is only its MODELS record
and its census entry (no engine is needed to refuse).
"""

from __future__ import annotations

import httpx
import pytest

from loopline.common.contracts.schemas import DeploymentInfo
from loopline.gateway.core.errors import ApiError
from loopline.gateway.tinker.training_api import _check_unembed
from support.census_replica import census_replica

GEMMA2 = DeploymentInfo(model="tiny-gemma2", deployment="tiny-gemma2", max_model_len=256, engine="vllm",
                         max_adapter_rank=32, architecture="Gemma2ForCausalLM", lora_lm_head=False)


@pytest.fixture(scope="module")
def gemma2_served(nats_proc):
    """A deployment as a Gemma 2 replica announces it, and a replica answering the census."""
    with census_replica(nats_proc.info["url"], GEMMA2, "test-gemma2-replica"):
        yield GEMMA2.model


def create_model(http: httpx.Client, base_model: str, **lora: object) -> httpx.Response:
    session = http.post("/api/v1/create_session",
                        json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"})
    assert session.status_code == 200, session.text
    return http.post("/api/v1/create_model", json={
        "session_id": session.json()["session_id"], "model_seq_id": 0, "base_model": base_model,
        "lora_config": {"rank": 8, **lora}})


def test_the_sdks_default_lora_without_lm_head_lora_is_refused_at_creation(gateway, gemma2_served):
    import tinker

    with httpx.Client(base_url=gateway.url, timeout=30, headers={"X-API-Key": "tml-test"}) as http:
        refused = create_model(http, gemma2_served)  # train_unembed: the SDK's default, True
    assert refused.status_code == 400, refused.text
    detail = str(refused.json())
    assert "train_unembed" in detail and "Gemma2ForCausalLM" in detail and "lm_head" in detail, detail

    with (tinker.ServiceClient(base_url=gateway.url, api_key="tml-test") as service,
          pytest.raises(tinker.BadRequestError, match="train_unembed")):
        service.create_lora_training_client(base_model=gemma2_served, rank=8).result()


def test_only_an_unembedding_lora_the_model_cannot_serve_is_refused():
    _check_unembed(GEMMA2, train_unembed=False)
    _check_unembed(GEMMA2.model_copy(update={"lora_lm_head": True}), train_unembed=True)
    _check_unembed(GEMMA2.model_copy(update={"lora_lm_head": None}), train_unembed=True)  # an older record
    with pytest.raises(ApiError) as refused:
        _check_unembed(GEMMA2, train_unembed=True)
    assert refused.value.status == 400 and refused.value.param == "lora_config.train_unembed"
