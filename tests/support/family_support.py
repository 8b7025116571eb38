"""What each model family supports, as README.md's "Supported models" table shows it: one source for
the table (tests/common/test_readme.py holds the README to ``table()``) and for the end-to-end tests
that prove each cell (tests/e2e/test_families.py and, for the tiny Llama and the embedder, the tests
the README names beside the table). A cell starts with ✓ (works, tested), "refused" (refused at
submission with why), or "—" (not applicable)."""

from __future__ import annotations

COLUMNS = ("served", "LoRA", "Tokenformer", "full", "Tinker LoRA", "tensor parallel", "embedding")
YES = "✓"
TP_REFUSED = "refused (422: Llama only)"
DENSE = {"served": YES, "LoRA": YES, "Tokenformer": YES, "full": YES, "Tinker LoRA": YES,
         "tensor parallel": TP_REFUSED, "embedding": "—"}

# family (the tiny model's name) -> (what real checkpoints it stands for, cells by column)
SUPPORT: dict[str, tuple[str, dict[str, str]]] = {
    "tiny": ("Llama 2/3, SmolLM2", {**DENSE, "tensor parallel": "✓ TP=2 equals TP=1"}),
    "tiny-qwen2": ("Qwen2, Qwen2.5", DENSE),
    "tiny-qwen3": ("Qwen3, Qwen3-Embedding", {**DENSE, "embedding": "✓ LoRA, with --convert embed"}),
    "tiny-gemma3": ("Gemma 3 (text)", DENSE),
    "tiny-mistral": ("Mistral", DENSE),
    "tiny-qwen3-moe": ("Qwen3-MoE", {**DENSE, "LoRA": "✓ attention, lm_head; experts refused",
                                     "Tinker LoRA": "✓ train_mlp=False; the default refused"}),
    "tiny-embed": ("BERT embedders", {"served": "✓ /v1/embeddings", "LoRA": "—", "Tokenformer": "—",
                                      "full": "—", "Tinker LoRA": "—", "tensor parallel": "refused",
                                      "embedding": "✓ LoRA"}),
}

def cell(family: str, column: str) -> str:
    return SUPPORT[family][1][column]


def table() -> str:
    """The README's table, in Markdown."""
    head = ["model", "stands for", *COLUMNS]
    rows = [head, ["---"] * len(head)]
    rows += [[f"`{family}`", real, *(cells[c] for c in COLUMNS)] for family, (real, cells) in SUPPORT.items()]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"
