"""A job's training params as one typed object (ScalarLM's ``train_args`` with our defaults), and the
job's config.json that carries them to the training program (``JobConfig``: the one encoding of that
file, for the trainer's jobs and the session worker's sampler saves alike).

One model for every reader: the gateway validates a submit with it (a bad value is a 422 naming
the field, before anything is stored) and hashes its canonical form, the trainer reads what it
launches by from it, and the training program (loopline.ml) trains by it.

Unknown keys are kept (ScalarLM clients send many: gpus, nodes, ...): they count in the job hash
and come back in the job's config, though nothing acts on them. A null means "not given". Standard
library and pydantic only: the training program imports it inside a Slurm job.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from loopline.common.atomic_files import write_atomic
from loopline.common.contracts.adapter_format import FULL_WEIGHTS, AdapterType
from loopline.common.contracts.hub_push import HubPushParams
from loopline.common.contracts.job_layout import CONFIG_FILE

# The Llama/Qwen/Mistral projection names: attention and MLP, the usual "all-linear" set.
TOKENFORMER_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Ranks of one tensor-parallel job: one Slurm task each.
MAX_TENSOR_PARALLEL = 1024


class _Params(BaseModel):
    """Numbers are strict (StrictInt, StrictFloat): true is not 1 and "10" is not 10."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        # Clients send `"seed": null`, `"lora_config": null`...: treat null as "not given".
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    def declared(self) -> dict[str, Any]:
        """The declared fields with their values; unknown keys are carried, never acted on."""
        return self.model_dump(include=set(type(self).model_fields))


class LoraParams(_Params):
    r: StrictInt = Field(8, ge=1)
    lora_alpha: StrictFloat = 32.0
    # 0, not ScalarLM's 0.1: few-example jobs memorise faster and more reliably without dropout.
    lora_dropout: StrictFloat = Field(0.0, ge=0.0, lt=1.0)
    target_modules: str | list[str] = "all-linear"


class TokenformerParams(_Params):
    num_tokens: StrictInt = Field(32, ge=1)
    target_modules: list[str] = Field(default_factory=lambda: list(TOKENFORMER_TARGET_MODULES))


class TrainParams(_Params):
    # The served model the job adapts; the gateway fills in the one it serves when absent.
    llm_name: str | None = None
    max_steps: StrictInt = Field(100, ge=1)
    learning_rate: StrictFloat = Field(3e-3, gt=0)
    batch_size: StrictInt = Field(1, ge=1)
    gradient_accumulation_steps: StrictInt = Field(4, ge=1)
    gradient_clip_value: StrictFloat = 1.0  # <= 0 turns clipping off
    warmup_steps: StrictInt = Field(0, ge=0)
    lr_decay: Literal["linear", "cosine", "constant"] = "linear"
    seed: StrictInt = 0
    steps_per_checkpoint: StrictInt = Field(100, ge=1)
    max_checkpoints_to_keep: StrictInt = Field(3, ge=1)
    adapter_type: AdapterType = "tokenformer"
    lora_config: LoraParams = Field(default_factory=LoraParams)
    tokenformer_config: TokenformerParams = Field(default_factory=TokenformerParams)
    # Pushed to the Hugging Face Hub by the trainer once COMPLETED (hub_push.py); None: not pushed.
    push_to_hub: HubPushParams | None = None
    # "auto": float32 on CPU (bf16 matmuls are slow there and lossy), bfloat16 on a GPU.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    max_seq_len: StrictInt | None = Field(None, ge=2)  # None: the model's max_position_embeddings
    # Ranks of loopline.ml.parallel; None: one process (loopline.ml.train), or, launched by hand,
    # every launched rank.
    tensor_parallel: StrictInt | None = Field(None, ge=1, le=MAX_TENSOR_PARALLEL)
    # Seconds one run may take; the trainer caps it at its own limit.
    timeout: StrictFloat | None = Field(None, gt=0)
    # ScalarLM's two modes: "language_model" trains on {input, output} rows; "embedding" trains a
    # pooling model on {sentence1, sentence2, score} rows, pulling each pair's cosine toward its score.
    training_mode: Literal["language_model", "embedding"] = "language_model"

    @field_validator("adapter_type", "lr_decay", "training_mode", mode="before")
    @classmethod
    def _lower(cls, value):
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _tensor_parallel_trains_full_weights(self) -> TrainParams:
        # loopline.ml.parallel trains full weights only: a job asking for an adapter is refused
        # when submitted rather than failing once launched, and one that names no type gets "none".
        if (self.tensor_parallel or 1) > 1:
            if "adapter_type" not in self.model_fields_set:
                self.adapter_type = FULL_WEIGHTS
            elif self.adapter_type != FULL_WEIGHTS:
                raise ValueError(f"tensor_parallel={self.tensor_parallel} trains full weights only: "
                                 f"adapter_type must be {FULL_WEIGHTS!r}, not {self.adapter_type!r}")
        return self

    @model_validator(mode="after")
    def _embedding_trains_in_one_process(self) -> TrainParams:
        # loopline.ml.parallel trains causal language models only.
        if self.training_mode == "embedding" and (self.tensor_parallel or 1) > 1:
            raise ValueError(f"training_mode 'embedding' trains in one process: tensor_parallel must be "
                             f"1, not {self.tensor_parallel}")
        return self


def canonical(params: TrainParams) -> dict[str, Any]:
    """The params as the client set them, validated: lower-cased names, nulls dropped, defaults left
    out. The job hash covers this, so ``{"seed": null}`` and ``{}``, or "LoRA" and "lora", are one
    job, while a default written out is still what the client asked for and names its own job."""
    return params.model_dump(mode="json", exclude_unset=True)


# TrainParams that travel (NATS, config.json, SQL) in their canonical form: each reader validates
# them again and gets the same fields set, so the defaults are applied by the one that trains.
CanonicalTrainParams = Annotated[TrainParams, PlainSerializer(canonical, return_type=dict)]


class JobConfig(BaseModel):
    """The job's config.json. Written by the trainer for a training job, and by the session worker
    for a Tinker sampler save (laid out as a job's, with only ``llm_name`` in its params, so that
    the checkpoint-watcher announces it like any job's checkpoint); read by the training program
    and the checkpoint-watcher."""

    model_config = ConfigDict(extra="ignore")

    job_hash: str
    model_path: str  # the base model's folder (or a Hugging Face id the program resolves)
    params: CanonicalTrainParams = Field(default_factory=TrainParams)

    @field_validator("params", mode="before")
    @classmethod
    def _params_null(cls, value):
        return {} if value is None else value

    @property
    def served_model(self) -> str:
        """The served model the job adapts: the name the replicas serve it under (the subject its
        checkpoints are announced on), or, for a job written by hand without one, its folder."""
        return self.params.llm_name or self.model_path

    @classmethod
    def read(cls, job_dir: Path):
        return cls.model_validate_json((Path(job_dir) / CONFIG_FILE).read_bytes())

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=True) + "\n"

    def write(self, job_dir: Path) -> None:
        """Replace the job's config.json whole: a reader never sees half of one."""
        write_atomic(Path(job_dir) / CONFIG_FILE, self.to_json())
