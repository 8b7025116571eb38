"""Our adapter checkpoints as folders vLLM's LoRA loader accepts (docs/adapter-format.md, "Serving in vLLM").

A Tokenformer adapter has LoRA's shapes: the scores ``x Kᵀ`` are LoRA's shrink with ``A = K``
(rank ``n``) and ``Θ(scores) V`` is the expand with ``B = Vᵀ``. So the converted folder is a PEFT
LoRA folder, and the plugin in ``tokenformer_vllm`` applies Θ between vLLM's shrink and expand for
the adapters it marks. LoRA checkpoints are already PEFT folders and are copied as they are.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from loopline.common.atomic_files import atomic_dir
from loopline.common.contracts import adapter_format
from loopline.common.contracts.adapter_format import FULL_WEIGHTS

# Marker and guard written into a converted Tokenformer folder's adapter_config.json.
# - ``adapter_type: "tokenformer"`` (our format's own field, kept) is what the plugin reads to know
#   the adapter needs Θ.
# - ``init_lora_weights`` set to this value makes every loader that does not know about Tokenformer
#   refuse the folder: vLLM without our plugin rejects unknown string inits ("vLLM does not support
#   init_lora_weights='loopline-tokenformer'"), and PEFT refuses it as an unknown initialisation. A
#   Tokenformer served as a plain LoRA would silently give wrong answers; this makes it fail loudly.
TOKENFORMER_INIT = "loopline-tokenformer"
PEFT_PREFIX = "base_model.model."
# Modules whose vLLM LoRA path does not go through the linear shrink/expand where Θ is applied.
_UNSUPPORTED_LEAVES = ("lm_head", "embed_tokens", "wte", "embed_in", "word_embeddings")


def to_vllm_lora(checkpoint_dir: str | Path, out_dir: str | Path) -> tuple[str, str]:
    """Write ``checkpoint_dir`` (one of our checkpoints) into ``out_dir`` as a vLLM LoRA folder.

    Returns ``(path, kind)``: the folder to put in ``LoRARequest(lora_path=...)`` and the adapter
    type (``"tokenformer"`` or ``"lora"``). The folder is written beside ``out_dir`` and renamed
    into place (an existing ``out_dir``, e.g. from an interrupted earlier attempt, is replaced), so
    an engine never reads a half-written adapter. It is a copy, not a link to the checkpoint,
    because vLLM re-reads the folder whenever the adapter falls out of its CPU cache
    (``max_cpu_loras``), possibly after training has rotated the checkpoint away. Full fine-tunes
    (``adapter_type: "none"``) are not adapters: ``ValueError``.
    """
    from loopline.ml.adapters.io import read_adapter_config

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    config = read_adapter_config(checkpoint_dir)
    kind = config["adapter_type"]
    if kind == FULL_WEIGHTS:
        raise ValueError(
            f"{checkpoint_dir}: adapter_type {kind!r} cannot be served as a vLLM adapter "
            "(a full fine-tune is a new model: serve it as a model folder)")
    # 0755: an engine may run as another user; the path never names a half-written folder.
    with atomic_dir(out_dir) as tmp:
        if kind == "lora":
            for name in adapter_format.FILES:
                shutil.copyfile(checkpoint_dir / name, tmp / name)
        else:
            _write_tokenformer(checkpoint_dir, config, tmp)
    return str(out_dir), kind


def tokenformer_lora_tensors(tensors: dict, num_tokens: int) -> dict:
    """``P.tokenformer_k`` / ``P.tokenformer_v`` → PEFT's ``lora_A`` (= K) / ``lora_B`` (= √n·Vᵀ).

    √n is Θ's scalar factor outside the norm; folding it into B lets the plugin apply the same Θ to
    every slot whatever its n (vLLM pads every adapter to ``max_lora_rank``, so the plugin does not
    see each adapter's own n; the zero padding adds nothing to the norm because GeLU(0) = 0).
    """
    import torch

    from loopline.ml.adapters.tokenformer import K_LEAF, V_LEAF

    out = {}
    scale = math.sqrt(num_tokens)
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module.rsplit(".", 1)[-1] in _UNSUPPORTED_LEAVES:
            raise ValueError(f"Tokenformer on {module} cannot be served by vLLM (only linear layers)")
        key = f"{PEFT_PREFIX}{module}"
        if leaf == K_LEAF:
            out[f"{key}.lora_A.weight"] = tensor.to(torch.float32).contiguous()
        elif leaf == V_LEAF:
            out[f"{key}.lora_B.weight"] = (tensor.to(torch.float32) * scale).t().contiguous()
        else:
            raise ValueError(f"unexpected tensor {name!r} in a Tokenformer checkpoint")
    return out


def _write_tokenformer(checkpoint_dir: Path, config: dict, out: Path) -> None:
    from loopline.ml.adapters.io import read_tensors, write_adapter

    n = int(config["num_tokens"])
    tensors = tokenformer_lora_tensors(read_tensors(checkpoint_dir), n)
    peft_fields = {
        "peft_type": "LORA",
        "r": n,
        # alpha = r: vLLM's scaling alpha/r is exactly 1 (it would fold any other value into B).
        "lora_alpha": n,
        "use_rslora": False,
        "use_dora": False,
        "bias": "none",
        "target_modules": sorted(config["target_modules"]),
        "init_lora_weights": TOKENFORMER_INIT,
        "inference_mode": True,
    }
    # Our fields (adapter_type, num_tokens, step, ...) stay: they say what the folder really is.
    merged = {**config, **peft_fields, "tokenformer_sqrt_n_folded_into_lora_b": True}
    write_adapter(out, merged, tensors)  # the adapter format's one writer
