"""Wire schemas: what travels over NATS between services.

These are the only types two services share. Each service converts them into its own internal
types (dataclasses) or SQL rows at its edge; nothing here knows about HTTP or SQL.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    n: int = Field(default=1, ge=1)


class WorkItem(BaseModel):
    """One prompt to generate for; one JetStream message on ``work.generate.<deployment>``."""

    request_id: str
    group: str
    index: int
    model: str
    # Exactly one of prompt / messages is set; inference applies the chat template to messages.
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: SamplingParams
    # A job hash: generate with that job's newest adapter on the deployment's base model. The
    # gateway resolves ``model`` (a job hash or ``latest``) to it; ``model`` keeps the name asked for.
    adapter: str | None = None
    # When set, inference also publishes token deltas on ``stream.<request_id>`` (core NATS).
    stream: bool = False
    # When set, inference also publishes the result there (core NATS, subjects.answer), so the
    # gateway waiting on the connection hears without a subscription per request.
    reply_to: str | None = None
    submitted_at: float = Field(default_factory=time.time)
    # The batch this prompt belongs to, as the gateway accepted it: what the ledger records for the
    # group without a lookup per group. None (a hand-made item) leaves the ledger to infer them.
    kind: Literal["generate", "upload", "openai"] | None = None
    batch_total: int | None = None


class ErrorInfo(BaseModel):
    """An error the client must see, with the HTTP status the gateway should answer with."""

    status: int
    message: str
    type: str = "invalid_request_error"


class Choice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    completion_tokens: int = 0


class ResultItem(BaseModel):
    """The outcome of one WorkItem; one JetStream message on ``results.<group>.<index>``."""

    request_id: str
    group: str
    index: int
    model: str
    choices: list[Choice] = Field(default_factory=list)
    prompt_tokens: int = 0
    error: ErrorInfo | None = None
    replica: str = ""
    # The adapter version (checkpoint step) the request was pinned to for its whole generation;
    # None for the base model. Lets a client tell which checkpoint produced an answer.
    adapter_step: int | None = None
    started_at: float = 0.0
    finished_at: float = Field(default_factory=time.time)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @classmethod
    def failure(cls, item: WorkItem, error: ErrorInfo, replica: str = "") -> ResultItem:
        """The answer for a work item that could not be served: the client sees ``error``."""
        return cls(request_id=item.request_id, group=item.group, index=item.index, model=item.model,
                   error=error, replica=replica)


class TokenDelta(BaseModel):
    """A streamed piece of text. ``tokens`` is the choice's token count so far, so a consumer can
    drop deltas it already forwarded when a redelivered request is generated a second time."""

    request_id: str
    choice: int = 0
    text: str
    tokens: int
    # As in ResultItem: a stream's chunks name the version that produced them before the result.
    adapter_step: int | None = None


class DeploymentInfo(BaseModel):
    """What a served model looks like; kept in the MODELS bucket by the inference replicas."""

    model: str
    deployment: str
    max_model_len: int
    engine: str
    created_at: float = Field(default_factory=time.time)


class BatchManifest(BaseModel):
    """Written before a batch's work is published, so any gateway can answer for the batch."""

    group: str
    total: int
    model: str
    kind: Literal["generate", "upload", "openai"]
    created_at: float = Field(default_factory=time.time)


class DeploymentLoad(BaseModel):
    pending: int = 0
    in_flight: int = 0

    @property
    def depth(self) -> int:
        return self.pending + self.in_flight


class QueueState(BaseModel):
    """Published on ``queue.state`` a few times a second; the gateway admits against it."""

    deployments: dict[str, DeploymentLoad] = Field(default_factory=dict)
    max_depth: int
    at: float = Field(default_factory=time.time)


class QueueMetrics(BaseModel):
    """The ScalarLM ``/v1/generate/metrics`` figures, computed by the queue service.
    Serialise with ``by_alias=True`` to get ScalarLM's ``token/s`` style keys."""

    model_config = ConfigDict(populate_by_name=True)

    queue_depth: int
    requests: int
    tokens: int
    total_time: float
    token_per_s: float = Field(alias="token/s")
    request_per_s: float = Field(alias="request/s")
    failed: int = 0
    flop_per_s: float = Field(default=0.0, alias="flop/s")


class ClearQueueReply(BaseModel):
    cleared: int


class ServiceStatus(BaseModel):
    """What ``svc.<service>.status`` answers: the gateway builds /v1/health from these."""

    service: str
    replica: str
    status: Literal["up", "starting", "down"] = "up"
    detail: dict[str, Any] = Field(default_factory=dict)
