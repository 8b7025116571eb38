"""Greedy generation with plain transformers: what a model folder, or a training checkpoint applied
to it, answers, computed without vLLM.

The yardstick for "the trained adapter learnt its pairs" and for "vLLM serves the adapter as the
ml/ reference computes it". Prompts are tokenized as vLLM's ``/v1/completions`` tokenizes a text
prompt (the raw text with the tokenizer's special tokens, no chat template), one prompt at a time
(no padding), in fp32; the completion is decoded without special tokens, as vLLM's text is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]  # the end-of-sequence token it stopped on included, as vLLM counts
    finish_reason: str  # "stop" (an end-of-sequence token) or "length" (max_tokens), as vLLM says


def greedy_completions(model_path: str, prompts: list[str], *, checkpoint: str | Path | None = None,
                       max_tokens: int = 24) -> list[Completion]:
    """Each prompt's greedy completion, up to ``max_tokens`` new tokens, by the base model or, with
    ``checkpoint`` (a training checkpoint folder of any adapter type), the adapted one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loopline.ml.adapters import apply_adapter

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    if checkpoint is not None:
        model = apply_adapter(model, checkpoint)
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    stop_ids = sorted({e for e in [*eos, tokenizer.eos_token_id] if e is not None})
    completions = []
    # Invariant: completions[i] is prompts[i]'s greedy completion.
    for prompt in prompts:
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones_like(torch.tensor([ids])),
                                 do_sample=False, max_new_tokens=max_tokens, eos_token_id=stop_ids,
                                 pad_token_id=tokenizer.pad_token_id)
        # Like vLLM's token_ids (and its usage count), these keep the end-of-sequence token.
        new = out[0, len(ids):].tolist()
        finish = "stop" if new and new[-1] in stop_ids else "length"
        completions.append(Completion(tokenizer.decode(new, skip_special_tokens=True), new, finish))
    return completions


def greedy_texts(model_path: str, prompts: list[str], *, checkpoint: str | Path | None = None,
                 max_tokens: int = 24) -> list[str]:
    """Only the texts of ``greedy_completions``."""
    return [c.text for c in greedy_completions(model_path, prompts, checkpoint=checkpoint,
                                               max_tokens=max_tokens)]
