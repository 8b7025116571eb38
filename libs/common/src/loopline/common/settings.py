"""One typed settings object per service, all read from ``LOOPLINE_*`` environment variables.

The shared fields live in ``CommonSettings``; each service's object adds its own. Field names map to
variables by upper-casing them: ``nats_url`` is ``LOOPLINE_NATS_URL``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOPLINE_", extra="ignore")

    nats_url: str = "nats://127.0.0.1:4222"
    # Where local state lives (NATS data, SQLite ledger, prepared models, logs).
    state_dir: Path = Path(".loopline")
    # Send traces to an OTLP collector when set; otherwise spans stay in-process.
    otlp_endpoint: str | None = None
    log_level: str = "INFO"
    # Names this process among replicas of its service; defaults to host-pid.
    replica_id: str | None = None

    # Prepared models (converted SmolLM2, the tiny test model); shared by stacks when set.
    models_path: Path | None = Field(default=None, validation_alias="LOOPLINE_MODELS_DIR")

    @property
    def models_dir(self) -> Path:
        return self.models_path or self.state_dir / "models"


class GatewaySettings(CommonSettings):
    host: str = "127.0.0.1"
    port: int = 8000
    # How long an idle HTTP connection stays open for its client's next request. Above the 60 s
    # idle timeout of common load balancers, so the gateway never closes a connection one of them
    # is about to reuse (a 502 for its client); uvicorn's own default is 5 s.
    keep_alive_s: int = Field(default=75, ge=1)
    # ScalarLM's long-poll window: prompts not done by then are answered with null.
    response_timeout_s: float = 60.0
    # Bodies larger than this are refused with 413 before they are read.
    max_body_bytes: int = 16 * 1024 * 1024
    max_upload_bytes: int = 1024 * 1024 * 1024
    # ScalarLM's client uploads batches above 128 prompts; /v1/generate refuses more than this.
    max_prompts_per_request: int = 1024
    default_max_tokens: int = 16
    # What a 429 tells the client to wait before retrying.
    retry_after_s: int = 2
    # The model that serves requests which name none (and that training jobs adapt by default).
    model: str = DEFAULT_MODEL
    # Training uploads: the archive may inflate to this many bytes and entries, no more (tar bombs).
    max_dataset_bytes: int = 4 * 1024 * 1024 * 1024
    max_archive_members: int = 10_000
    # ScalarLM's chunked upload: its client sends 50 MiB chunks; unfinished uploads expire after the TTL.
    max_chunk_bytes: int = 100 * 1024 * 1024
    upload_ttl_s: float = 6 * 3600
    # How long a trainer request may take; a submit reads the dataset back and calls sbatch.
    trainer_timeout_s: float = 30.0
    # Comma-separated; when set, /v1 routes want "Authorization: Bearer <key>" (401 otherwise).
    # Empty: no keys, as ScalarLM (whose client sends none).
    api_keys: str = ""

    @property
    def api_key_set(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())


class QueueSettings(CommonSettings):
    database_url: str | None = None
    # Admission control: pending + in-flight prompts per deployment above this answer 429.
    max_queue_depth: int = 4096
    state_interval_s: float = 0.2
    # How many ledger rows are written in one transaction at most, and how long the ledger waits
    # for more once it has caught up (it is a record, not on any request's path).
    ledger_batch: int = 256
    ledger_linger_s: float = Field(default=0.5, ge=0)
    # The ledger is off the hot path by design; where it shares cores with the gateway, NATS and
    # inference (make up, a small node) the lowest CPU priority lets it run only on what they
    # leave: measured on 2 cores, at nice 5 it still took a quarter of the shared core in a burst.
    nice: int = Field(default=19, ge=0, le=19)

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.state_dir / 'loopline.db').resolve()}"


class InferenceSettings(CommonSettings):
    model: str = DEFAULT_MODEL
    # The name clients use; defaults to ``model``.
    served_model_name: str | None = None
    engine: str = Field(default="auto", pattern="^(auto|vllm|reference)$")
    max_model_len: int | None = None
    # Requests in the engine at once; the replica pulls only as many as it has room for.
    max_inflight: int = 64
    dtype: str = "auto"
    # JetStream redelivers a request whose replica has not acked it within this window.
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    # Run-time adapters (checkpoints announced on CHECKPOINTS): off serves the base model only.
    adapters: bool = True
    # LRU bound: jobs whose adapter stays loaded at once (a version still finishing requests after
    # its job moved on is extra, briefly). An evicted job reloads at its next request.
    max_adapters: int = Field(default=8, ge=1)
    # The largest adapter rank vLLM serves (LoRA's r, a Tokenformer's num_tokens); it sizes the
    # buffers vLLM sets aside per adapter slot.
    max_adapter_rank: int = Field(default=64, ge=1)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


class TrainerSettings(CommonSettings):
    database_url: str | None = None
    # One directory per job (config, dataset, code, logs, checkpoints); must be visible to the
    # Slurm compute nodes under the same path.
    jobs_path: Path | None = Field(default=None, validation_alias="LOOPLINE_JOBS_DIR")
    # auto: Slurm when `sbatch` is on PATH and its controller answers (`scontrol ping`), else a
    # local process per job (same interface).
    launcher: str = Field(default="auto", pattern="^(auto|slurm|local)$")
    # A job's own ml/ code runs with the trainer's privileges on the cluster: off unless trusted.
    allow_user_code: bool = False
    max_code_bytes: int = 64 * 1024 * 1024
    # How often unfinished jobs are compared with the launcher and their events published.
    reconcile_interval_s: float = 2.0
    # A job that ends this many times in a row without progress (no new step) is failed.
    max_resubmits: int = 5
    # The longest one Slurm allocation may run; longer jobs are resumed in further allocations.
    max_train_time_s: int = 24 * 3600
    slurm_partition: str | None = None
    # Extra sbatch arguments, split like a shell would (e.g. "--account=ml --qos=low").
    slurm_extra_args: str = ""
    # Replaces `python -m loopline.ml.train` (and `.parallel`) in the entrypoint; `--job-dir DIR`
    # is appended. For stand-in programs in tests and for sites with their own wrapper.
    train_command: str | None = None
    # The served model: what a job trains when its params name no llm_name.
    model: str = DEFAULT_MODEL

    @property
    def jobs_dir(self) -> Path:
        return self.jobs_path or self.state_dir / "jobs"

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.state_dir / 'loopline.db').resolve()}"


class CheckpointWatcherSettings(CommonSettings):
    # The trainer's job directories (same variable and default as TrainerSettings.jobs_dir).
    jobs_path: Path | None = Field(default=None, validation_alias="LOOPLINE_JOBS_DIR")
    # New checkpoints are noticed through inotify within ~10 ms. Every job is also compared with
    # the cursor this often: the safety net for events inotify cannot see (a volume written by
    # another node over NFS, a full inotify queue). Where inotify never fires, this is the latency.
    rescan_interval_s: float = Field(default=2.0, gt=0)
    # Off: no inotify at all, only the rescan (set a short interval then, e.g. 0.1).
    inotify: bool = True
    # A checkpoint whose adapter file is larger than this is rejected (full-weight checkpoints of
    # a large model do not belong in the message bus).
    max_adapter_bytes: int = Field(default=2 * 1024**3, gt=0)

    @property
    def jobs_dir(self) -> Path:
        return self.jobs_path or self.state_dir / "jobs"


class StackSettings(CommonSettings):
    """The embedded default started by ``make up``."""

    host: str = "127.0.0.1"
    port: int = 8000
    nats_port: int = 4222
    nats_monitor_port: int = 8222
    model: str = DEFAULT_MODEL
    inference_replicas: int = 1
