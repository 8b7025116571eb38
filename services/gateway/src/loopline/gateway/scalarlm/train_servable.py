"""A training job its base model's deployment could not train or serve is refused at submission.

Known from the deployment record its replicas write (contracts/schemas.py ``DeploymentInfo``): a
training mode the model is not served for (an embedding job adapts a pooling model, a language-model
job a generating one), tensor parallelism that loopline.ml.parallel does not build for the model
class, and a LoRA on layers the replicas take none on (a mixture of experts on CPU). Each is a 422
naming the param and saying what would work, before the dataset is stored: the job would otherwise
fail once launched, or train and then be refused by every replica. A base model no deployment
serves (an admin's own) is left to the training program.
"""

from __future__ import annotations

from loopline.common.contracts.model_support import TENSOR_PARALLEL_ARCHITECTURES
from loopline.common.contracts.schemas import DeploymentInfo
from loopline.common.contracts.train_params import TrainParams
from loopline.gateway.core.errors import ApiError

# PEFT's shorthand for every linear layer (the LoRA default, LoraParams.target_modules).
ALL_LINEAR = "all-linear"
# The vLLM task a deployment must serve for a job of each training mode to be served by it.
_TASK_OF_MODE = {"language_model": "generate", "embedding": "embed"}


def check_servable(info: DeploymentInfo | None, params: TrainParams) -> None:
    if info is None:
        return
    _check_training_mode(info, params)
    _check_tensor_parallel(info, params)
    if params.adapter_type == "lora":
        _check_lora_layers(info, params.lora_config.target_modules)


def _check_training_mode(info: DeploymentInfo, params: TrainParams) -> None:
    task = _TASK_OF_MODE[params.training_mode]
    if task in info.tasks:
        return
    kind = "a pooling (embedding) model" if "embed" in info.tasks else "a generative model"
    raise ApiError(422, f"params.training_mode {params.training_mode!r} needs a model served for "
                        f"{task!r}, but {info.model!r} is {kind} (vLLM tasks: {', '.join(info.tasks)}): "
                        f"use training_mode {_mode_for(info.tasks)!r} or another llm_name",
                   param="params.training_mode")


def _mode_for(tasks: list[str]) -> str:
    return next((mode for mode, task in _TASK_OF_MODE.items() if task in tasks), "language_model")


def _check_tensor_parallel(info: DeploymentInfo, params: TrainParams) -> None:
    if (params.tensor_parallel or 1) <= 1 or info.architecture is None:
        return
    if info.architecture not in TENSOR_PARALLEL_ARCHITECTURES:
        raise ApiError(422, f"params.tensor_parallel={params.tensor_parallel} is not supported for "
                            f"{info.model!r}: Loopline's megatron-core tensor parallelism builds "
                            f"{', '.join(TENSOR_PARALLEL_ARCHITECTURES)} only, and this model is "
                            f"{info.architecture}; leave tensor_parallel out to train it in one process",
                       param="params.tensor_parallel")


def _check_lora_layers(info: DeploymentInfo, targets: str | list[str]) -> None:
    allowed = info.lora_modules
    if allowed is None:
        return
    wanted = [targets] if isinstance(targets, str) else list(targets)
    outside = [t for t in wanted if t not in allowed]
    if outside:
        what = "every linear layer, the experts and their router included" if outside == [ALL_LINEAR] else (
            ", ".join(outside))
        raise ApiError(422, f"params.lora_config.target_modules: {what} cannot be served for "
                            f"{info.model!r} ({info.architecture}): its replicas take a LoRA on "
                            f"{', '.join(allowed)} only (a mixture of experts on CPU: vLLM runs LoRA "
                            f"beside experts on GPU kernels only); set target_modules to some of those",
                       param="params.lora_config.target_modules")
