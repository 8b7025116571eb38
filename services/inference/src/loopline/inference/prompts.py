"""From a WorkItem to token ids: chat template, tokenization, and the context-length check.

Done here, once, for every engine, so that a request too long for the model is refused with a clear
400 that names the numbers, instead of being cut short silently.
"""

from __future__ import annotations

from loopline.common.schemas import WorkItem
from loopline.inference.engine import GenerationRequest, Sampling


class PromptError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class PromptBuilder:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def token_ids(self, item: WorkItem) -> list[int]:
        if item.messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise PromptError(400, "this model has no chat template: use /v1/completions")
            try:
                text = self.tokenizer.apply_chat_template(
                    item.messages, add_generation_prompt=True, tokenize=False
                )
            except Exception as exc:  # a template error is the request's fault
                raise PromptError(400, f"messages do not fit the model's chat template: {exc}") from exc
            # The template already holds the special tokens it wants.
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(item.prompt or "", add_special_tokens=True)

    def build(self, item: WorkItem) -> GenerationRequest:
        ids = self.token_ids(item)
        if not ids:
            raise PromptError(400, "the prompt is empty")
        s = item.sampling
        if len(ids) + s.max_tokens > self.max_model_len:
            raise PromptError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(ids)} and max_tokens asks for {s.max_tokens} more: shorten the prompt or "
                f"lower max_tokens to at most {max(self.max_model_len - len(ids), 0)}",
            )
        sampling = Sampling(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            stop=tuple(s.stop),
            seed=s.seed,
            n=s.n,
        )
        return GenerationRequest(item.request_id, ids, sampling, stream=item.stream)
