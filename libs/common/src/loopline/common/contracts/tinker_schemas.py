"""Wire schemas of the Tinker API inside Loopline: what crosses NATS, and the KV records.

The HTTP bodies are the ``tinker`` SDK's own types (``tinker.types``, ``tinker.proto``): the gateway
parses them with those. These are ours: a call on its way to a session worker, a future's result,
and the records the gateway, the trainer and the workers share (names and layout in
``tinker_names.py``).
"""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

from pydantic import BaseModel, Field

CallKind = Literal["create_model", "forward_backward", "optim_step", "save_weights_for_sampler",
                   "save_weights", "load_weights", "unload_model"]
ErrorCategory = Literal["user", "server", "unknown"]


class Payload(BaseModel):
    """Bytes that travel inside a message (base64) or, when too large for one, in the
    ``tinker-blobs`` object store under ``blob``."""

    data_b64: str | None = None
    blob: str | None = None
    size: int = 0

    @classmethod
    def inline(cls, data: bytes) -> Payload:
        return cls(data_b64=base64.b64encode(data).decode(), size=len(data))

    def inline_bytes(self) -> bytes:
        assert self.data_b64 is not None, "a blob is read from the object store"
        return base64.b64decode(self.data_b64)


class StepCall(BaseModel):
    """One training call on ``tinker.calls.<worker>``. A worker runs each model's calls in
    ``seq_id`` order (the SDK's per-client counter), whatever order they arrived in."""

    request_id: str
    model_id: str
    seq_id: int | None = None  # None: run on arrival (a model's first call)
    kind: CallKind
    # The SDK's JSON request as sent (the route's tinker.types model), or for forward_backward the
    # protobuf ForwardBackwardRequest, zstd already undone.
    body: str = "{}"
    proto: Payload | None = None
    submitted_at: float = Field(default_factory=time.time)


class FutureResult(BaseModel):
    """One message on ``tinker.futures.<request id>``: what ``retrieve_future`` answers."""

    request_id: str
    # The training run a training call's future is of (None for a sample's): retrieve_future shows
    # it only to a key that may see that run (gateway auth/tenancy.py).
    model_id: str | None = None
    ok: bool = True
    media_type: str = "application/json"  # application/x-protobuf for forward_backward
    payload: Payload | None = None
    error: str | None = None
    category: ErrorCategory = "server"
    finished_at: float = Field(default_factory=time.time)

    def error_body(self) -> dict[str, Any]:
        """The SDK's RequestFailedResponse: a user error fails fast, others may be retried."""
        return {"error": self.error or "failed", "category": self.category}


class LoraSpec(BaseModel):
    """The SDK's LoraConfig as the worker applies it."""

    rank: int = Field(ge=1, le=256)
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class TinkerSession(BaseModel):
    session_id: str
    created_at: float = Field(default_factory=time.time)
    heartbeat_at: float = Field(default_factory=time.time)
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, str] = Field(default_factory=dict)
    finished: str | None = None  # the reason the SDK gave when it closed the session
    # The name of the API key that made it (gateway/auth/tenancy.py); None when keys are off. Another
    # key without admin is answered as if it did not exist.
    owner: str | None = None


class TinkerModel(BaseModel):
    """A training client's model: where it lives, and what it adapts."""

    model_id: str
    session_id: str
    base_model: str  # the served model name (what the replicas serve, the adapters adapt)
    model_path: str  # the folder the worker loads
    model_name: str  # the base model as the client named it (get_info answers with it)
    lora: LoraSpec
    worker_id: str
    created_at: float = Field(default_factory=time.time)
    last_request_at: float = Field(default_factory=time.time)
    user_metadata: dict[str, str] = Field(default_factory=dict)
    state: Literal["active", "released", "failed"] = "active"
    error: str | None = None
    owner: str | None = None  # as TinkerSession.owner: its checkpoints and futures are its owner's


class TinkerWorker(BaseModel):
    worker_id: str
    base_model: str
    model_path: str
    launcher: str = ""
    run_id: str | None = None  # the launcher's id (Slurm job id, local pid)
    state: Literal["starting", "ready", "released", "failed"] = "starting"
    started_at: float = Field(default_factory=time.time)
    heartbeat_at: float = 0.0
    models: list[str] = Field(default_factory=list)  # model ids resident now
    error: str | None = None


class TinkerWorkerList(BaseModel):
    workers: list[TinkerWorker]


class PlaceModel(BaseModel):
    """Gateway -> trainer: put this model on a worker for its base model (start one if needed),
    then hand the worker its first call (``first``: create_model or load_weights)."""

    model: TinkerModel  # worker_id empty: the trainer fills it in
    first: StepCall


class TinkerSampler(BaseModel):
    """A sampling session: which weights its samples come from."""

    sampling_session_id: str
    base_model: str
    adapter: str | None = None  # the sampler hash of the saved weights; None samples the base
    model_path: str | None = None  # the tinker path it was made from
    step: int | None = None
    created_at: float = Field(default_factory=time.time)
    # When it was last written: a sampling session in use is written again now and then, so that
    # its bucket's TTL (LOOPLINE_TINKER_SESSIONS_MAX_AGE_S) takes only abandoned ones.
    written_at: float | None = None  # None: when created
    owner: str | None = None  # as TinkerSession.owner
    # The Tinker session it belongs to (its sequences train only there); None when it was made
    # outside one (an asample naming a path or base model).
    session_id: str | None = None

    @property
    def written(self) -> float:
        return self.written_at or self.created_at


class SampledRecord(BaseModel):
    """What a sample request with ``record_stability_info`` keeps for StableReinforce, read by the
    session worker when a datum's provenance names one of its sequences (``<request id>:<i>``):
    the tokens it may claim, and the sampler's logprobs it trains against. Arrays are base64 of
    little-endian int32 / float32."""

    request_id: str
    session_id: str | None  # the sampler's Tinker session: its sequences train only there
    owner: str | None = None
    prompt_b64: str
    tokens_b64: list[str]  # one per sample
    logprobs_b64: list[str]  # one per sample, one logprob per token
    created_at: float = Field(default_factory=time.time)


class TinkerCheckpoint(BaseModel):
    model_id: str
    checkpoint_type: Literal["training", "sampler"]
    name: str
    tinker_path: str
    created_at: float = Field(default_factory=time.time)
    size_bytes: int = 0
    adapter: str | None = None  # sampler checkpoints: the adapter hash the replicas serve
    step: int = 0  # optimizer steps taken when it was saved
    expires_at: float | None = None


class SessionEvent(BaseModel):
    """One message on ``events.sessions.<worker>.<kind>``."""

    worker_id: str
    kind: str
    model_id: str | None = None
    base_model: str | None = None
    step: int | None = None
    loss: float | None = None  # a "step": the sum of its forward_backward losses since the step before
    learning_rate: float | None = None  # a "step": the AdamW learning rate it took
    path: str | None = None
    detail: str | None = None
    # A "step" event's sampled sequences trained since the step before, by how many optimizer steps
    # behind the trainer their sampler's weights were (contracts/sampler_version.py)...
    staleness: dict[int, int] | None = None
    # ...and how many came from other weights: the base model, another run, or no stamp found.
    unstamped: int | None = None
    # A "metrics" event: what the run's client reported for ``step`` (POST
    # /v1/tinker/runs/{run}/metrics: the cookbook's reward and the like), drawn on the dashboard.
    metrics: dict[str, float] | None = None
    time: float = Field(default_factory=time.time)
