"""Request bodies of the OpenAI-compatible routes. Unknown fields are accepted and ignored, as
OpenAI's own clients send fields a server may not know; known fields are checked strictly."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class CommonParams(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(CommonParams):
    prompt: str | list[str]
    echo: bool = False
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(CommonParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None

    def messages_as_dicts(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):  # content parts: only text is served here
                content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
            out.append({**m.model_dump(exclude_none=True), "content": content or ""})
        return out
