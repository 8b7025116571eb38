"""Wire schemas: what travels over NATS between services.

These are the only types two services share. Each service converts them into its own internal
types (dataclasses) or SQL rows at its edge; nothing here knows about HTTP or SQL.
"""

from __future__ import annotations

import base64
import json
import time
import zlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The HTTP routes of vLLM's OpenAI-compatible server that travel through the queue: a work item
# names one, and the replica hands its body to vLLM's own serving layer for that route.
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
POOLING_ROUTES = ("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                  "/v1/rerank", "/v2/rerank")
TOKENIZER_ROUTES = ("/tokenize", "/detokenize")
QUEUED_ROUTES = GENERATION_ROUTES + POOLING_ROUTES + TOKENIZER_ROUTES
# Result bodies longer than this (characters) travel compressed (ResultItem.with_body).
COMPRESS_ABOVE = 32 * 1024


class WorkItem(BaseModel):
    """One client request to serve; one JetStream message on ``work.generate.<deployment>``.

    ``body`` is the client's JSON text as it came (vLLM's request schema, validated by vLLM in the
    replica): text, not a parsed object, so what vLLM sees is byte for byte what the client sent,
    escapes such as a lone ``\\ud800`` included.
    """

    request_id: str
    group: str
    index: int
    # The name the client asked for (a model, a job hash or ``latest``).
    model: str
    route: str
    body: str
    # A job hash: serve with that job's newest adapter on the deployment's base model, pinned for
    # the whole request. The gateway resolves ``model`` (a job hash or ``latest``) to it.
    adapter: str | None = None
    # When set, the result is also published there at once (core NATS, subjects.answer), so the
    # gateway waiting on the connection hears without a subscription per request; a streamed
    # response's events go to ``stream.<request_id>`` as they are made (stream_event below).
    reply_to: str | None = None
    stream: bool = False
    submitted_at: float = Field(default_factory=time.time)
    # The batch this request belongs to, as the gateway accepted it: what the ledger records for the
    # group without a lookup per group. None (a hand-made item) leaves the ledger to infer them.
    kind: Literal["generate", "upload", "openai"] | None = None
    batch_total: int | None = None


class ErrorInfo(BaseModel):
    """An error the client must see, with the HTTP status the gateway should answer with."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None

    def openai_body(self) -> str:
        """OpenAI's error shape, as vLLM's server writes it."""
        return json.dumps(openai_error(self.status, self.message, self.type, self.param), ensure_ascii=False)


def openai_error(status: int, message: str, type: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object, ``{"error": {message, type, param, code}}``, as its clients read it."""
    return {"error": {"message": message, "type": type, "param": param, "code": status}}


class ResultItem(BaseModel):
    """The outcome of one WorkItem; one JetStream message on ``results.<group>.<index>``.

    ``status`` and ``body`` are the HTTP answer as vLLM's server would give it (for a streamed
    answer, ``body`` is the whole ``text/event-stream`` transcript: the stored record a gateway
    relays from when it missed events). ``error`` repeats a failure's message for readers that do
    not parse bodies (the ledger, ScalarLM's results).
    """

    request_id: str
    group: str
    index: int
    model: str
    status: int = 200
    body: str = ""
    # Instead of ``body`` for a large answer: the body, zlib-compressed, base64 (see with_body).
    body_zlib: str | None = None
    media_type: str = "application/json"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: ErrorInfo | None = None
    replica: str = ""
    # The adapter version (checkpoint step) the request was pinned to for its whole generation;
    # None for the base model. Lets a client tell which checkpoint produced an answer.
    adapter_step: int | None = None
    started_at: float = 0.0
    finished_at: float = Field(default_factory=time.time)

    @property
    def streamed(self) -> bool:
        return self.media_type.startswith("text/event-stream")

    @staticmethod
    def with_body(text: str) -> dict[str, Any]:
        """The body fields for ``text``: as it is, or compressed when it is large. NATS carries
        at most 1 MiB a message by default, and a streamed answer's transcript repeats its id and
        field names in every event: 128 events of the tiny model are 32 KiB, and zlib makes
        such transcripts about ten times smaller."""
        if len(text) <= COMPRESS_ABOVE:
            return {"body": text, "body_zlib": None}
        packed = zlib.compress(text.encode(), 1)
        return {"body": "", "body_zlib": base64.b64encode(packed).decode()}

    def text(self) -> str:
        """The body, uncompressed."""
        if self.body_zlib is None:
            return self.body
        return zlib.decompress(base64.b64decode(self.body_zlib)).decode()

    def events(self) -> list[str]:
        """A streamed answer's events (each ``data: ...\\n\\n``), in order."""
        return [e + "\n\n" for e in self.text().split("\n\n") if e]

    @classmethod
    def failure(cls, item: WorkItem, error: ErrorInfo, replica: str = "") -> ResultItem:
        """The answer for a work item that could not be served: the client sees ``error``."""
        return cls(request_id=item.request_id, group=item.group, index=item.index, model=item.model,
                   status=error.status, body=error.openai_body(), error=error, replica=replica)


def stream_event(seq: int, event: bytes) -> bytes:
    """One event of a streamed answer as published on ``stream.<request_id>``: its position, a
    newline, the event's bytes. Positions let a gateway skip what it already relayed when a
    redelivered request is served again from the start."""
    return b"%d\n%s" % (seq, event)


def parse_stream_event(data: bytes) -> tuple[int, bytes]:
    seq, _, event = data.partition(b"\n")
    return int(seq), event


class DeploymentInfo(BaseModel):
    """What a served model looks like; kept in the MODELS bucket by the inference replicas."""

    model: str
    deployment: str
    max_model_len: int
    engine: str
    # What vLLM serves this model for (its supported tasks: "generate", "embed", ...).
    tasks: list[str] = Field(default_factory=lambda: ["generate"])
    created_at: float = Field(default_factory=time.time)
    # The folder the replicas load (a Tinker client may name the base model by it), and the largest
    # adapter rank they serve (a Tinker training client asking for more is refused up front).
    model_path: str | None = None
    max_adapter_rank: int | None = None
    # The model class vLLM serves it with, and whether that class takes a LoRA on lm_head (Tinker's
    # train_unembed; inference/lora_targets.py): a client asking for one it cannot serve is refused
    # when it is created. None: not known (a record from before these fields).
    architecture: str | None = None
    lora_lm_head: bool | None = None
    # The layers (PEFT's names) its replicas take a LoRA on, when not every linear layer (None):
    # a mixture of experts on CPU (contracts/model_support.py). A job or training client targeting
    # others is refused when it is submitted.
    lora_modules: list[str] | None = None


class BatchManifest(BaseModel):
    """Written before a batch's work is published, so any gateway can answer for the batch."""

    group: str
    total: int
    model: str
    kind: Literal["generate", "upload", "openai"]
    created_at: float = Field(default_factory=time.time)
    # The API key that submitted it (gateway/auth/tenancy.py); None when keys are off. Another key
    # without admin polls or downloads it as an unknown batch.
    owner: str | None = None


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
