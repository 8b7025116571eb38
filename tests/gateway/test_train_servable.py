"""What a deployment could not train or serve is refused at submission (scalarlm/train_servable.py),
read from the record its replicas write: tensor parallelism on a model class loopline.ml.parallel
does not build, a LoRA on layers a mixture of experts on CPU takes none on. The records here are
what real replicas of the families' tiny models write (tests/e2e/test_families.py submits through
real ones)."""

from __future__ import annotations

import pytest

from loopline.common.contracts.model_support import MOE_CPU_LORA_MODULES
from loopline.common.contracts.schemas import DeploymentInfo
from loopline.common.contracts.train_params import TrainParams
from loopline.gateway.core.errors import ApiError
from loopline.gateway.scalarlm.train_servable import check_servable


def record(model: str, architecture: str, lora_modules: list[str] | None = None) -> DeploymentInfo:
    return DeploymentInfo(model=model, deployment=model, max_model_len=256, engine="vllm",
                          max_adapter_rank=64, architecture=architecture, lora_lm_head=True,
                          lora_modules=lora_modules)


LLAMA = record("tiny", "LlamaForCausalLM")
QWEN3 = record("tiny-qwen3", "Qwen3ForCausalLM")
MOE = record("tiny-qwen3-moe", "Qwen3MoeForCausalLM", list(MOE_CPU_LORA_MODULES))


def refusal(info: DeploymentInfo, **params) -> ApiError:
    with pytest.raises(ApiError) as refused:
        check_servable(info, TrainParams.model_validate(params))
    assert refused.value.status == 422
    return refused.value


def test_tensor_parallel_is_refused_where_megatron_does_not_build_the_class():
    check_servable(LLAMA, TrainParams(tensor_parallel=2))
    check_servable(QWEN3, TrainParams(tensor_parallel=1))
    error = refusal(QWEN3, tensor_parallel=2)
    assert error.param == "params.tensor_parallel"
    assert "Qwen3ForCausalLM" in error.message and "LlamaForCausalLM" in error.message


def test_a_lora_on_a_moe_on_cpu_must_name_layers_its_replicas_serve():
    # The default, every linear layer, reaches the experts and their router.
    error = refusal(MOE, adapter_type="lora")
    assert error.param == "params.lora_config.target_modules"
    assert "experts" in error.message and "q_proj" in error.message
    error = refusal(MOE, adapter_type="lora", lora_config={"target_modules": ["q_proj", "gate"]})
    assert "gate cannot be served" in error.message
    check_servable(MOE, TrainParams.model_validate(
        {"adapter_type": "lora", "lora_config": {"target_modules": ["q_proj", "v_proj", "lm_head"]}}))
    # Other adapters, and a deployment taking a LoRA on every layer, are not asked.
    check_servable(MOE, TrainParams(adapter_type="tokenformer"))
    check_servable(QWEN3, TrainParams(adapter_type="lora"))


def test_a_base_model_no_deployment_serves_is_left_to_the_training_program():
    check_servable(None, TrainParams(tensor_parallel=2, adapter_type="none"))


def test_a_training_mode_needs_a_model_served_for_it():
    embedder = DeploymentInfo(model="tiny-embed", deployment="tiny-embed", max_model_len=256, engine="vllm",
                              tasks=["embed"], architecture="BertModel")
    check_servable(embedder, TrainParams(training_mode="embedding"))
    check_servable(LLAMA, TrainParams())
    error = refusal(LLAMA, training_mode="embedding")
    assert error.param == "params.training_mode" and "a generative model" in error.message
    error = refusal(embedder)  # a language-model job
    assert "'embedding'" in error.message and "a pooling (embedding) model" in error.message
