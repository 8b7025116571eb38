"""Tiny random models of the families people deploy, on the tiny model's tokenizer, built in seconds.

``tiny`` is a Llama; these are the others: Qwen2, Qwen3, Gemma 3 (text), Mistral and a
mixture-of-experts model (Qwen3-MoE). Each is built from its own transformers config class with
the shape traits real checkpoints of the family have, scaled down, because those traits are what
breaks serving and training:

- Qwen2: biases on q/k/v (0.5B-72B all have them), heads x head_dim = hidden size, tied embeddings
  (0.5B, 1.5B).
- Qwen3: q/k norms, head_dim 128 whatever the hidden size (0.6B: 16 heads x 128 = 2048 ≠ 1024),
  tied embeddings (0.6B-4B).
- Gemma 3: head_dim 256 ≠ hidden size / heads (270M: 4 x 256 ≠ 640), sliding-window layers between
  global ones, embeddings scaled by √hidden, a zero-centred RMSNorm, tied embeddings.
- Mistral: heads x head_dim = hidden size, no sliding window (v0.3), untied embeddings.
- Qwen3-MoE: every layer sparse, 128 experts of which 8 are routed (here 8 and 2), q/k norms,
  untied embeddings.

    python -m loopline.ml.models tiny-qwen3 --models-dir .loopline/models   # prints the folder
    python -m loopline.ml.models.families --out-dir .loopline/models        # builds every family
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .tiny import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    SEED,
    atomic_output_dir,
    build_tokenizer,
    portable_tokenizer_class,
)


@dataclass(frozen=True)
class Family:
    """One family's tiny model: the name it is built under and its transformers config."""

    name: str
    architecture: str  # the ``architectures`` entry, as vLLM and transformers resolve it
    config: Callable[[dict[str, int]], Any]  # special token ids -> a transformers config
    moe: bool = False


# The tiny Llama's scale (tiny.py): 2 layers, 64-128 wide, 0.3 initialisation so that a few steps
# learn. Head sizes are ones vLLM's CPU attention takes (32, 64, 80, ...; 16 fails at the first
# request: "Unsupported CPU attention configuration: head_dim=16"), as every real checkpoint's are.
_COMMON: dict[str, Any] = {"num_hidden_layers": 2, "max_position_embeddings": 2048, "initializer_range": 0.3}


def _ids(ids: dict[str, int]) -> dict[str, Any]:
    return {"bos_token_id": ids[IM_START], "eos_token_id": ids[IM_END], "pad_token_id": ids[ENDOFTEXT]}


def _qwen2(ids: dict[str, int]):
    from transformers import Qwen2Config

    # Qwen2Config takes no head_dim: hidden / heads, as in every Qwen2 checkpoint.
    return Qwen2Config(vocab_size=0, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                       num_key_value_heads=1, tie_word_embeddings=True, **_COMMON, **_ids(ids))


def _qwen3(ids: dict[str, int]):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=0, hidden_size=64, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, **_COMMON,
                       **_ids(ids))


def _gemma3(ids: dict[str, int]):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(vocab_size=0, hidden_size=64, intermediate_size=256, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64,
                            sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                            tie_word_embeddings=True, **_COMMON, **_ids(ids))


def _mistral(ids: dict[str, int]):
    from transformers import MistralConfig

    return MistralConfig(vocab_size=0, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64, sliding_window=None,
                         tie_word_embeddings=False, **_COMMON, **_ids(ids))


def _qwen3_moe(ids: dict[str, int]):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=0, hidden_size=64, intermediate_size=256, moe_intermediate_size=64,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                            **_COMMON, **_ids(ids))
    config.head_dim = 32  # not in the config class's signature; its attention reads it
    return config


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("tiny-qwen2", "Qwen2ForCausalLM", _qwen2),
    Family("tiny-qwen3", "Qwen3ForCausalLM", _qwen3),
    Family("tiny-gemma3", "Gemma3ForCausalLM", _gemma3),
    Family("tiny-mistral", "MistralForCausalLM", _mistral),
    Family("tiny-qwen3-moe", "Qwen3MoeForCausalLM", _qwen3_moe, moe=True),
)}


def family_of(name: str) -> Family | None:
    """The family ``name`` builds ("tiny-qwen3" or "loopline/tiny-qwen3"), or None."""
    return FAMILIES.get(name.lower().removeprefix("loopline/"))


def build_family_model(family: Family, out_dir: Path) -> Path:
    """Build ``family``'s tiny model into ``out_dir`` (replacing it) and return the folder.

    Deterministic: building twice gives byte-identical weights.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END)}
    config = family.config(ids)
    config.vocab_size = len(tokenizer)
    config.architectures = [family.architecture]
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config).float()
    model.generation_config = GenerationConfig(**_ids(ids))
    with atomic_output_dir(Path(out_dir)) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        portable_tokenizer_class(tmp)
    return Path(out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the tiny model of every family (or those named).")
    parser.add_argument("--out-dir", type=Path, required=True, help="models folder: <out-dir>/<name>")
    parser.add_argument("names", nargs="*", default=list(FAMILIES), help=f"default: {' '.join(FAMILIES)}")
    args = parser.parse_args(argv)
    for name in args.names:
        family = family_of(name)
        if family is None:
            parser.error(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
        print(build_family_model(family, args.out_dir / family.name))


if __name__ == "__main__":
    main()
