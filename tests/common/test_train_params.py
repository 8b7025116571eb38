"""The training params (loopline.common.contracts.train_params): one model for the gateway, the trainer
and the training program, and the canonical form they travel in."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loopline.common.contracts.job_schemas import JobInfo, JobStatus
from loopline.common.contracts.train_params import (
    TOKENFORMER_TARGET_MODULES,
    JobConfig,
    TrainParams,
    canonical,
)


def test_defaults_nulls_and_unknown_keys():
    p = TrainParams.model_validate({"seed": None, "lora_config": {"r": 4}, "gpus": 8, "lr_decay": "Cosine",
                                    "tokenformer_config": None})
    assert p.seed == 0 and p.lora_config.r == 4 and p.lora_config.lora_alpha == 32 and p.lr_decay == "cosine"
    assert p.tokenformer_config.num_tokens == 32 and p.max_steps == 100 and p.adapter_type == "tokenformer"
    assert p.tokenformer_config.target_modules == list(TOKENFORMER_TARGET_MODULES)
    assert p.llm_name is None and p.tensor_parallel is None and p.timeout is None
    # Unknown keys survive, and what the client set is what the canonical form holds.
    assert canonical(p) == {"lora_config": {"r": 4}, "gpus": 8, "lr_decay": "cosine"}


@pytest.mark.parametrize("raw, field", [
    ({"adapter_type": "dora"}, "adapter_type"),
    ({"max_steps": 0}, "max_steps"),
    ({"max_steps": True}, "max_steps"),  # not 1
    ({"max_steps": "10"}, "max_steps"),  # not 10
    ({"learning_rate": float("nan")}, "learning_rate"),
    ({"tensor_parallel": "two"}, "tensor_parallel"),
    ({"tensor_parallel": 1025}, "tensor_parallel"),
    ({"timeout": -1}, "timeout"),
    ({"llm_name": 5}, "llm_name"),
    ({"lora_config": {"r": 0}}, "lora_config.r"),
])
def test_bad_values_name_their_field(raw, field):
    with pytest.raises(ValidationError) as caught:
        TrainParams.model_validate(raw)
    assert ".".join(str(p) for p in caught.value.errors()[0]["loc"]) == field


def test_tensor_parallel_trains_full_weights():
    assert TrainParams.model_validate({"tensor_parallel": 2}).adapter_type == "none"
    assert canonical(TrainParams.model_validate({"tensor_parallel": 2}))["adapter_type"] == "none"
    assert TrainParams.model_validate({"tensor_parallel": 1}).adapter_type == "tokenformer"
    with pytest.raises(ValidationError, match="full weights only"):
        TrainParams.model_validate({"tensor_parallel": 2, "adapter_type": "lora"})


def test_params_travel_in_canonical_form():
    """JobInfo and config.json carry what was set: read back, the same fields are set."""
    params = TrainParams.model_validate({"max_steps": 7, "nodes": 1})
    info = JobInfo(job_hash="a" * 64, status=JobStatus.QUEUED, params=params, llm_name="m",
                   adapter_type="tokenformer", job_directory="/jobs/x", created_at=0.0)
    wire = info.model_dump(mode="json")
    assert wire["params"] == {"max_steps": 7, "nodes": 1}
    again = JobInfo.model_validate(wire).params
    assert again.model_fields_set == params.model_fields_set and again.max_steps == 7

    config = JobConfig(job_hash="a" * 64, model_path="/models/tiny", params=params)
    assert JobConfig.model_validate_json(config.to_json()).params == params
    with pytest.raises(ValidationError):
        JobInfo.model_validate({**wire, "adapter_type": "dora"})
