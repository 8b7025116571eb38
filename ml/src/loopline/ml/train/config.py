"""The job's config.json as one typed object: ScalarLM-style train params with our defaults.

Unknown keys are ignored (ScalarLM clients send many: gpus, nodes, timeout, ...); they still
count in the job hash, which the trainer computes, not us.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loopline.ml.adapters.tokenformer import DEFAULT_TARGET_MODULES


class _Params(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        # Clients send `"seed": null`, `"lora_config": null`...: treat null as "not given".
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class LoraParams(_Params):
    r: int = Field(8, ge=1)
    lora_alpha: float = 32
    # 0, not ScalarLM's 0.1: few-example jobs memorise faster and more reliably without dropout.
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: str | list[str] = "all-linear"


class TokenformerParams(_Params):
    num_tokens: int = Field(32, ge=1)
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))


class TrainParams(_Params):
    max_steps: int = Field(100, ge=1)
    learning_rate: float = Field(3e-3, gt=0)
    batch_size: int = Field(1, ge=1)
    gradient_accumulation_steps: int = Field(4, ge=1)
    gradient_clip_value: float = 1.0  # <= 0 turns clipping off
    warmup_steps: int = Field(0, ge=0)
    lr_decay: Literal["linear", "cosine", "constant"] = "linear"
    seed: int = 0
    steps_per_checkpoint: int = Field(100, ge=1)
    max_checkpoints_to_keep: int = Field(3, ge=1)
    adapter_type: Literal["tokenformer", "lora", "none"] = "tokenformer"
    lora_config: LoraParams = Field(default_factory=LoraParams)
    tokenformer_config: TokenformerParams = Field(default_factory=TokenformerParams)
    # "auto": float32 on CPU (bf16 matmuls are slow there and lossy), bfloat16 on a GPU.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    max_seq_len: int | None = Field(None, ge=2)  # None: the model's max_position_embeddings

    @field_validator("adapter_type", "lr_decay", mode="before")
    @classmethod
    def _lower(cls, value):
        return value.lower() if isinstance(value, str) else value


class JobConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    job_hash: str
    model_path: str
    params: TrainParams = Field(default_factory=TrainParams)

    @field_validator("params", mode="before")
    @classmethod
    def _params_null(cls, value):
        return {} if value is None else value


def load_job_config(job_dir: Path) -> JobConfig:
    return JobConfig.model_validate(json.loads((Path(job_dir) / "config.json").read_text()))
