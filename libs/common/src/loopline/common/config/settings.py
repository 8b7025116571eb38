"""One typed settings object per service, all read from ``LOOPLINE_*`` environment variables.

The shared fields live in ``CommonSettings``; each service's object adds its own. Field names map to
variables by upper-casing them: ``nats_url`` is ``LOOPLINE_NATS_URL``. Every field's
``description`` is what the README's configuration table says about it
(``python -m loopline.common.config.settings_doc`` prints that table; a test keeps the two equal).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, JsonValue, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

MiB = 1024 * 1024
GiB = 1024 * MiB


def unset_means(text: str) -> dict[str, JsonValue]:
    """For a field whose ``None`` stands for a value derived at run time: that value, as the
    configuration table shows it (``json_schema_extra`` of its Field)."""
    return {"unset_means": text}


DATABASE_DESCRIPTION = ("The SQL database of the request ledger (queue) and the job registry "
                        "(trainer), migrated at start; any SQLAlchemy URL, `postgresql://…` included.")
DEFAULT_DATABASE = "SQLite `$LOOPLINE_STATE_DIR/loopline.db`"
JOBS_DIR_DESCRIPTION = ("One directory per training job (config, dataset, code, logs, checkpoints): "
                        "the trainer writes it, Slurm jobs run in it, the checkpoint-watcher reads it.")


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOPLINE_", extra="ignore")

    nats_url: str = Field(default="nats://127.0.0.1:4222", description="The NATS server (JetStream on).")
    state_dir: Path = Field(default=Path(".loopline"), description=(
        "Where local state lives: the SQLite database, prepared models and job directories unless "
        "set elsewhere; staged uploads (gateway), unpacked adapters (inference); NATS data and logs "
        "under `make up`."))
    otlp_endpoint: str | None = Field(default=None, description=(
        "Send traces to this OTLP/HTTP collector; unset, trace ids still travel in NATS headers "
        "but no spans are recorded."))
    log_level: str = Field(default="INFO", description="Python logging level.")
    metrics_port: int = Field(default=0, description=(
        "Where this process serves its Prometheus metrics, `http://<host>:<port>/metrics` on every "
        "interface: 0 picks a free port (the URL is logged, and is `metrics_url` in the service's "
        "status and `metrics` in its `/v1/health` entry), a negative value turns it off. Set it per "
        "service: processes on one host cannot share a port."))
    replica_id: str | None = Field(default=None, json_schema_extra=unset_means("`<host>-<pid>`"),
                                   description="Names this process among the replicas of its service.")
    models_path: Path | None = Field(
        default=None, validation_alias="LOOPLINE_MODELS_DIR",
        json_schema_extra=unset_means("`$LOOPLINE_STATE_DIR/models`"),
        description=("Prepared models (converted SmolLM2, the tiny test model) and where a Hugging "
                     "Face id is resolved; shared by stacks when set."))
    # Retention of what NATS keeps (bus.ensure_topology applies it to existing streams too). Every
    # service may create the topology, so these are common: give every service the same values.
    results_max_age_s: float = Field(default=24 * 3600, gt=0, description=(
        "How long the RESULTS stream keeps an answer (and the BATCHES bucket a batch's manifest): "
        "the time a ScalarLM client has to collect it."))
    datasets_max_age_s: float = Field(default=30 * 24 * 3600, ge=0, description=(
        "How long the `datasets` object store keeps an upload (0: forever). The trainer copies a "
        "job's dataset into the job's directory when the job is submitted, so this only has to "
        "cover upload -> submit; a month also spares resubmitting clients the upload."))
    adapters_max_age_s: float = Field(default=0, ge=0, description=(
        "How long the `adapters` object store keeps a checkpoint (0: forever). A replica started "
        "later downloads each job's latest from there, so by default it stays while its job exists; "
        "deleting the job purges it."))
    # A session is written again at every heartbeat (the SDK sends one every few seconds while its
    # client lives), a sampling session when it is used: only abandoned ones go.
    tinker_sessions_max_age_s: float = Field(default=24 * 3600, gt=0, description=(
        "How long the `TINKER_SESSIONS` and `TINKER_SAMPLERS` buckets keep a Tinker session or "
        "sampling session after it was last heartbeated or used; then it is gone (410/404)."))
    # Clients make events (a run's metrics, a job's steps): unbounded, a flood filled JetStream's
    # store and WORK and RESULTS publishes failed. Dropping the oldest keeps every publish working.
    events_max_bytes: int = Field(default=512 * MiB, ge=1 * MiB, description=(
        "The most bytes the EVENTS stream (job, adapter and Tinker session events, run metrics) "
        "keeps; past it the oldest events are dropped, so a flood of events never fills NATS's "
        "store (new events are always taken)."))

    @property
    def models_dir(self) -> Path:
        return self.models_path or self.state_dir / "models"


MAX_REQUEST_BYTES_DESCRIPTION = (
    "The most bytes one Tinker `forward_backward` (or `forward`) may expand to: every datum's tokens "
    "and loss inputs, sparse ones densified, sized from their shapes before any of it is made. The "
    "gateway answers a larger one 400 before a session worker sees it; the worker, which reads this "
    "too, refuses one with a `user` error.")
MAX_CLIENTS_DESCRIPTION = (
    "How many Tinker training clients one session worker holds at once; one more is refused "
    "(a `user` error, its record failed) until an idle one is released.")


class GatewaySettings(CommonSettings):
    model: str = Field(default=DEFAULT_MODEL, description=(
        "The served model a request that names none goes to, and a training job's `llm_name` when "
        "its params name none"))
    host: str = Field(default="127.0.0.1", description="Where the gateway listens.")
    port: int = Field(default=8000, description="The gateway's HTTP port.")
    # Above the 60 s idle timeout of common load balancers, so the gateway never closes a connection
    # one of them is about to reuse (a 502 for its client); uvicorn's own default is 5 s.
    keep_alive_s: int = Field(default=75, ge=1, description=(
        "How long an idle HTTP connection stays open for its client's next request."))
    response_timeout_s: float = Field(default=60.0, description=(
        "ScalarLM's long-poll window: prompts not done by then are answered with `null`."))
    max_body_bytes: int = Field(default=16 * MiB, description=(
        "Larger request bodies are refused with 413 before they are read."))
    max_upload_bytes: int = Field(default=1 * GiB, description=(
        "The same for uploads (`/v1/generate/upload`, `/v1/megatron/train`, an upload chunk, a "
        "chunked upload's declared total)."))
    # ScalarLM's client itself switches to /v1/generate/upload above 128 prompts.
    max_prompts_per_request: int = Field(default=1024, description=(
        "More prompts in one `/v1/generate` get 413 (use `/v1/generate/upload`)."))
    default_max_tokens: int = Field(default=16, description="`max_tokens` of a request that names none.")
    # Tinker's quick start asks for 8; RL recipes for up to 64 or so. Each sample is a sequence the
    # gateway holds (and vLLM generates): the count is a memory bound, not a style rule.
    max_samples_per_request: int = Field(default=128, ge=1, description=(
        "More samples of one prompt (Tinker `num_samples`, OpenAI `n` and `best_of`) get 400."))
    # ScalarLM's client polls the ids of one /v1/generate call (at most max_prompts_per_request);
    # every id is waited on for the whole long poll.
    max_ids_per_poll: int = Field(default=1024, ge=1, description=(
        "More `request_ids` in one `/v1/generate/get_results` get 413."))
    max_list_limit: int = Field(default=1000, ge=1, description=(
        "The largest `limit` of a list route (Tinker's training runs and sessions); more gets 400."))
    # Counted per gateway, over LOOPLINE_TINKER_SESSIONS_MAX_AGE_S: with that TTL it bounds what
    # one key keeps in the buckets. An RL loop makes a sampling session per saved step.
    max_tinker_sessions_per_key: int = Field(default=10_000, ge=1, description=(
        "How many Tinker sessions and sampling sessions one API key (or one client address without "
        "keys) may create at one gateway within `LOOPLINE_TINKER_SESSIONS_MAX_AGE_S`; more get 429."))
    # Each live client is a LoRA and its AdamW state resident in the shared session worker
    # (LOOPLINE_TINKER_MAX_CLIENTS there): below that, one key cannot take a worker whole. Recipes
    # keep a handful each; counted over every gateway (the TINKER_MODELS records).
    max_tinker_models_per_key: int = Field(default=32, ge=1, description=(
        "How many live Tinker training clients (created, and not yet released or failed) one API "
        "key (all clients together without keys) may hold; one more `create_model` (or client from "
        "saved state) gets 429, which the SDK does not retry, until one idles out "
        "(`LOOPLINE_TINKER_IDLE_TTL_S`)."))
    # The SDK cuts a call at ~5 MB of proto; dense, that is ~5 MB. A sparse tensor is sized by its
    # shape, not its bytes: 400 KB of them once grew a shared worker by 7 GB.
    tinker_max_request_bytes: int = Field(default=256 * MiB, ge=1 * MiB,
                                          description=MAX_REQUEST_BYTES_DESCRIPTION)
    # The SDK's get_tokenizer() runs AutoTokenizer.from_pretrained(tokenizer_id) on the client's
    # machine: a folder of the gateway's machine only loads there (found by `make compose-test`:
    # every remote client's get_tokenizer() failed on the container's path).
    tinker_tokenizer_id: Literal["name", "folder"] = Field(default="name", description=(
        "What Tinker's `get_info` gives as `tokenizer_id`, which the SDK's `get_tokenizer()` loads "
        "on the client's machine: `name`, the model's name (a Hub id a client anywhere can load), or "
        "`folder`, the prepared model's folder on this machine (no Hub needed, but only a client on "
        "this machine can load it; `make up` sets it)."))
    max_streams_per_key: int = Field(default=16, ge=1, description=(
        "How many event streams (SSE: training events, logs) one API key, or one client address "
        "without keys, may hold open at once; one more gets 429."))
    # Each post is an EVENTS message of up to ~10 KB that every open dashboard page hears; a
    # cookbook loop posts once per iteration (seconds apart).
    run_metrics_per_minute: int = Field(default=120, ge=1, description=(
        "How many `POST /v1/tinker/runs/{run}/metrics` one API key, or one client address without "
        "keys, may make per minute at one gateway (bursts of a tenth of it); more get 429 with "
        "`Retry-After`."))
    # An entry per holder (key, or client address without keys) seen lately; the least recently
    # seen are forgotten past this many, so a client with many addresses cannot grow the table.
    max_tracked_clients: int = Field(default=10_000, ge=100, description=(
        "How many API keys or client addresses each per-client quota (Tinker sessions, run "
        "metrics) remembers at one gateway; past it the least recently seen is forgotten."))
    retry_after_s: int = Field(default=2, description="The `Retry-After` of a 429.")
    # Longer than a replica's restart (vLLM loads the tiny model in ~20 s on 2 cores), so a replica
    # being replaced does not turn its requests away; a deployment gone for good is known in a minute.
    replica_grace_s: float = Field(default=60.0, gt=0, description=(
        "A request for a model no inference replica has served for this long is answered 503 with "
        "`Retry-After` at once (what was queued for it stays queued)."))
    max_dataset_bytes: int = Field(default=4 * GiB, description=(
        "A training archive may inflate to this many bytes, no more (tar bombs)."))
    max_archive_members: int = Field(default=10_000, description=(
        "A training archive may hold this many entries, no more."))
    # ScalarLM's client sends 50 MiB chunks.
    max_chunk_bytes: int = Field(default=100 * MiB, description=(
        "The largest chunk of ScalarLM's chunked training upload."))
    # Each chunk costs an object-store lookup at every init and finalize: chunk_size=1 for 1 GiB
    # would be a billion of them. ScalarLM's 50 MiB chunks make 21 for the 1 GiB default.
    max_upload_chunks: int = Field(default=1024, ge=1, description=(
        "A chunked upload may declare this many chunks, no more (413 at init)."))
    # A line is parsed whole (json.loads); 40 MB of it costs three times that at the peak.
    max_dataset_line_bytes: int = Field(default=4 * MiB, ge=1, description=(
        "One line of a training dataset may be this long, no more: refused (413) while the upload "
        "is read, before the line is held in memory."))
    upload_ttl_s: float = Field(default=6 * 3600, description=(
        "An unfinished chunked upload is deleted after this long."))
    # The tinker SDK gives up on one poll after 45 s and then backs off; it re-polls at once after
    # a try_again, so the gateway holds a poll for less than that and answers try_again.
    tinker_poll_s: float = Field(default=30.0, gt=0, lt=45, description=(
        "How long a Tinker `retrieve_future` is held before it is answered `try_again`."))
    # Long enough for a submit, which reads the dataset back and calls sbatch.
    trainer_timeout_s: float = Field(default=30.0, description=(
        "How long a request to the trainer may take before the gateway answers 504."))
    # Empty means no keys, as ScalarLM (whose client sends none).
    api_keys: str = Field(default="", description=(
        "Comma-separated API keys; when set, every route but the health probes, `/metrics` and the "
        "OpenAPI pages wants `Authorization: Bearer <key>` (`X-API-Key` on the Tinker API; 401 "
        "otherwise). These keys hold every scope."))
    # Re-read when it changes (at most once a second), so keys are added and revoked without a
    # restart; `loopline keys create/list/revoke` writes it.
    api_keys_file: Path | None = Field(default=None, description=(
        "A JSON file of hashed API keys, each with its scopes (`inference`, `training`, `admin`) and "
        "limits, written by `loopline keys`; when set, keys are on (with `LOOPLINE_API_KEYS` too)."))
    # A job's llm_name is loaded by the trainer as given: a server path or any Hub id. One tenant
    # should not pick what the training machines read or download (auth/tenancy.py).
    allow_any_base_model: bool = Field(default=False, description=(
        "Let a key without the admin scope train any `llm_name` (a server path, a Hub id); off, its "
        "`llm_name` must be a model this deployment serves (400 otherwise). Admin keys, and every "
        "request when keys are off, may always name any."))
    # A page left open holds one event stream; the cluster's state and the list of jobs and runs
    # are read once for every open page of the gateway (ui/listings.py), at most this often.
    ui_refresh_s: float = Field(default=2.0, ge=0.2, le=60, description=(
        "How often an open dashboard page (`/ui`) is brought up to date when nothing happens; an "
        "event (a step, a checkpoint, an adapter loaded) updates it at once."))
    # Events come at the rate clients make them; each update re-lists every job and run.
    ui_event_refresh_s: float = Field(default=0.5, ge=0.05, le=60, description=(
        "The shortest time between two updates of the open dashboard pages: events that come "
        "faster are shown together, with one listing of the jobs and runs per gateway for all of "
        "its pages, however many events and pages there are."))
    # A working day; the session ends sooner when its browser signs out or its key is revoked or
    # rotated (auth/ui_sessions.py).
    ui_session_max_age_s: float = Field(default=12 * 3600, ge=60, le=30 * 24 * 3600, description=(
        "How long a dashboard sign-in (`/ui`) lasts: its session, kept in the `UI_SESSIONS` bucket "
        "(whose TTL this sets), then ends and the browser is sent to the sign-in page."))
    # Each sign-in is one record in NATS for the session's lifetime: a key's holder must not be
    # able to fill the bucket by signing in in a loop.
    max_ui_sessions_per_key: int = Field(default=100, ge=1, description=(
        "How many dashboard sign-ins one API key may make at one gateway within "
        "`LOOPLINE_UI_SESSION_MAX_AGE_S`; more get 429."))
    # Empty: a browser page may change state only from the gateway's own origin (auth/same_origin.py).
    allowed_origins: str = Field(default="", description=(
        "Comma-separated origins (`https://app.example.com`) of web pages whose browsers may send "
        "the gateway state-changing requests (anything but GET, HEAD, OPTIONS) besides its own "
        "origin; other pages' get 403, decided from `Origin` and `Sec-Fetch-Site`. Clients that are "
        "not browsers send neither header and are not affected. On a loopback `LOOPLINE_HOST` every "
        "request must also name the gateway `localhost` or a loopback address (DNS rebinding), "
        "unless it comes from one of these origins."))

    @property
    def api_key_set(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())

    @property
    def allowed_origin_set(self) -> frozenset[str]:
        return frozenset(o.strip() for o in self.allowed_origins.split(",") if o.strip())


class QueueSettings(CommonSettings):
    database_url: str | None = Field(default=None, description=DATABASE_DESCRIPTION,
                                     json_schema_extra=unset_means(DEFAULT_DATABASE))
    max_queue_depth: int = Field(default=4096, description=(
        "Admission control: waiting + running prompts per model above this answer 429."))
    state_interval_s: float = Field(default=0.2, description=(
        "How often the queue depth is published to the gateways (`queue.state`)."))
    ledger_batch: int = Field(default=256, description="The most ledger rows written in one transaction.")
    ledger_linger_s: float = Field(default=0.5, ge=0, description=(
        "How long the caught-up ledger waits for more rows to write a bigger batch (it is a record, "
        "off every request's path)."))
    # Where the ledger shares cores with the gateway, NATS and inference (make up, a small node) the
    # lowest priority lets it run only on what they leave: measured on 2 cores, at nice 5 it still
    # took a quarter of the shared core in a burst.
    nice: int = Field(default=19, ge=0, le=19, description="The queue process's CPU priority (`nice`).")

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.state_dir / 'loopline.db').resolve()}"


class InferenceSettings(CommonSettings):
    model: str = Field(default=DEFAULT_MODEL, description=(
        "the model this replica serves: a Hugging Face id or a local folder"))
    served_model_name: str | None = Field(default=None, json_schema_extra=unset_means("`$LOOPLINE_MODEL`"),
                                          description="The name clients use for the served model.")
    vllm_args: str = Field(default="", description=(
        "Further `vllm serve` flags for this deployment, applied last (e.g. `--tool-call-parser "
        "hermes --enable-auto-tool-choice`, `--runner pooling`): the replica runs vLLM's own "
        "OpenAI server in-process with exactly the flags `vllm serve` would get."))
    max_model_len: int | None = Field(default=None, json_schema_extra=unset_means("the model's"),
                                      description="The context length.")
    max_inflight: int = Field(default=64, description=(
        "Requests in the engine at once; the replica pulls only as many as it has room for."))
    dtype: str = Field(default="auto", description=(
        "The engine's dtype (`auto`: the engine's choice for the model; float32 for vLLM on CPU)."))
    ack_wait_s: float = Field(default=30.0, description=(
        "JetStream redelivers a request whose replica has not acked it within this window."))
    max_deliver: int = Field(default=5, description=(
        "Deliveries of a request before it fails with an error in its result instead of being "
        "tried again."))
    adapters: bool = Field(default=True, description=(
        "Serve the checkpoints announced on `CHECKPOINTS` as run-time adapters; off serves the base "
        "model only (and runs vLLM without LoRA support)."))
    # A version still finishing requests after its job moved on is extra, briefly.
    max_adapters: int = Field(default=8, ge=1, description=(
        "Jobs whose adapter stays loaded at once (LRU; an evicted job reloads at its next request); "
        "also vLLM's adapters per batch."))
    # It sizes the buffers vLLM sets aside per adapter slot.
    max_adapter_rank: int = Field(default=64, ge=1, description=(
        "The largest adapter rank served (LoRA's `r`, a Tokenformer's `num_tokens`)."))
    # Measured: a tiny mixture of experts' engine starts in 30-51 s on 2 idle cores and took over
    # 300 s beside a busy test suite; a 70B model's weights alone take minutes to read.
    full_weights_start_timeout_s: float = Field(default=900.0, gt=0, description=(
        "How long a full fine-tune's own engine may take to start before its checkpoint is marked "
        "not deployed (`deployment_error`)."))
    # Each is a whole vLLM engine (its weights and its KV cache): what a replica's host can hold.
    max_full_weight_engines: int = Field(default=1, ge=1, description=(
        "Full fine-tunes' own engines (`vllm serve` children) running or starting at once on one "
        "replica; a request for another waits for one to be free (the least recently used idle "
        "one is stopped; a busy one takes no new requests and stops once its last one ends)."))
    # Covers the engine ahead in the queue finishing its requests, stopping and the next starting.
    full_weights_queue_timeout_s: float = Field(default=300.0, gt=0, description=(
        "How long a request for a full fine-tune may wait for a free engine "
        "(`LOOPLINE_MAX_FULL_WEIGHT_ENGINES`) before it is answered 503."))

    @field_validator("model")
    @classmethod
    def _one_model(cls, model: str) -> str:
        if "," in model:
            raise ValueError(f"LOOPLINE_MODEL={model!r}: a replica serves one model; several, comma-"
                             "separated, are for the stack (make up), which starts replicas per model")
        return model

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


SHARED_PASSES_DESCRIPTION = (
    "Whether a session worker runs the `forward_backward` calls of different clients that are ready "
    "at once in shared passes over the base model (each row through its own client's adapter). "
    "Unset: on a GPU only. On CPU a pass costs as much as its rows whatever the grouping (tiny "
    "model: one pass of 32 rows 104-122 ms, 4 passes of 8 rows 96-101 ms), so there they run one "
    "after the other.")


class TrainerSettings(CommonSettings):
    database_url: str | None = Field(default=None, description=DATABASE_DESCRIPTION,
                                     json_schema_extra=unset_means(DEFAULT_DATABASE))
    # Must be visible to the Slurm compute nodes under the same path.
    jobs_path: Path | None = Field(default=None, validation_alias="LOOPLINE_JOBS_DIR",
                                   json_schema_extra=unset_means("`$LOOPLINE_STATE_DIR/jobs`"),
                                   description=JOBS_DIR_DESCRIPTION)
    launcher: str = Field(default="auto", pattern="^(auto|slurm|local)$", description=(
        "`slurm`, `local` (a process per job, same interface) or `auto`: Slurm when `sbatch` is on "
        "PATH and its controller answers (`scontrol ping`)."))
    # A job's own ml/ code runs with the trainer's privileges on the cluster: off unless trusted.
    allow_user_code: bool = Field(default=False, description=(
        "Run a job's own `ml/` code (arbitrary code); off, such a job is refused with 403 (an `ml/` "
        "identical to the installed `loopline.ml` is not user code: accepted, the installed one "
        "runs). `make up` turns it on unless set."))
    max_code_bytes: int = Field(default=64 * MiB, description=(
        "The most bytes a job's `ml/` code may unpack to."))
    # What a job's code writes is read by the trainer (maybe root), for every job: each read has a
    # bound checked before the rest is read, so one job cannot take the trainer's memory.
    # The training program's status.json is about 100 KB (1,024 history points at most).
    max_status_bytes: int = Field(default=1 * MiB, ge=1024, description=(
        "The largest `status.json` a job may write; a larger one fails the job, naming this setting."))
    # Each line becomes one NATS message, so it stays well under NATS's max_payload (1 MiB).
    max_event_line_bytes: int = Field(default=256 * 1024, ge=1024, description=(
        "The longest line of a job's `events.jsonl` (a line with no newline this long counts); a longer "
        "one fails the job, naming this setting."))
    # A log is the program's own output, only shown: a long line (a progress bar redrawn with \r) is
    # no fault of the job, so it is cut rather than failing it.
    max_log_line_bytes: int = Field(default=64 * 1024, ge=256, description=(
        "A line of a job's log longer than this is cut at this length in the logs it is served in, "
        "with a note of its full length; the job goes on."))
    max_log_page_bytes: int = Field(default=512 * 1024, ge=1024, description=(
        "The most bytes of log lines (as JSON) in one reply of the trainer; the reply says there are "
        "more and the gateway asks again. Keep it under NATS's max_payload."))
    # ScalarLM's training_history_length (the program thins its history to it): a job's whole
    # honest history fits one page.
    max_history_points: int = Field(default=1024, ge=1, description=(
        "The most loss-history points (and checkpoints) one job's reply carries; more are paged with "
        "`history_offset` and `history_limit`, a larger `history_limit` gets 422."))
    # A job sees an allowlist of the trainer's environment (contracts/job_env.py), never its secrets.
    job_env_allow: str = Field(default="", description=(
        "More variables a training job may see, comma-separated (`SITE_VAR,SITE_*`: a trailing `*` "
        "is a prefix), beyond the built-in allowlist (PATH, HOME, locale, CUDA/NCCL/torch/HF, the "
        "job's own `LOOPLINE_*`); secrets (`*_KEY`, `*_TOKEN`, `*PASSWORD*`, `*SECRET*`, "
        "`*CREDENTIAL*`, `*JWT*`, `*AUTH*`, the database URL, API keys) are never passed, and URLs "
        "lose their `user:password@`."))
    job_user: str | None = Field(default=None, json_schema_extra=unset_means(
        "a uid of its own per job (`job_uid_range`) when the trainer runs as root"), description=(
        "The one user every job's own `ml/` code runs as (when allowed; jobs can then read each "
        "other's files); `root` keeps the trainer's user."))
    job_uid_range: str = Field(default="200000000-200999999", description=(
        "The uids (first-last, no passwd entries needed) a root trainer gives jobs with their own "
        "`ml/` code, one per job, so one job's code cannot read another job's directory."))
    tinker_worker_nats_url: str | None = Field(default=None, json_schema_extra=unset_means(
        "`$LOOPLINE_NATS_URL`"), description=(
        "The NATS URL a Tinker session worker gets, with the `tinker-worker` credentials where NATS "
        "has authentication on (compose and Helm set it; see nats_permissions.py)."))
    reconcile_interval_s: float = Field(default=2.0, description=(
        "How often unfinished jobs are compared with the launcher and their events published."))
    max_resubmits: int = Field(default=5, description=(
        "A job that ends this many times in a row without progress (no new step) is failed."))
    max_train_time_s: int = Field(default=24 * 3600, description=(
        "The longest one Slurm allocation may run; longer jobs resume in further allocations."))
    slurm_partition: str | None = Field(default=None, description="The Slurm partition jobs go to.")
    slurm_extra_args: str = Field(default="", description=(
        "Extra `sbatch` arguments, split like a shell would (e.g. `--account=ml --qos=low`)."))
    # For stand-in programs in tests and for sites with their own wrapper.
    train_command: str | None = Field(default=None, description=(
        "Replaces `python -m loopline.ml.train` (and `.parallel`) in a job's entrypoint; "
        "`--job-dir DIR` is appended."))
    model: str = Field(default=DEFAULT_MODEL, description=(
        "the model a job adapts when its params name no `llm_name`"))
    tinker_idle_ttl_s: float = Field(default=1800.0, gt=0, description=(
        "A Tinker training client idle this long is released (its state is lost unless saved); a "
        "session worker left with none exits, freeing its Slurm allocation."))
    tinker_worker_command: str | None = Field(default=None, description=(
        "Replaces `python -m loopline.tinker_worker` in a session worker's entrypoint."))
    tinker_shared_passes: bool | None = Field(default=None, description=SHARED_PASSES_DESCRIPTION)
    # Passed on to the session workers it starts, which enforce them.
    tinker_max_request_bytes: int = Field(default=256 * MiB, ge=1 * MiB,
                                          description=MAX_REQUEST_BYTES_DESCRIPTION)
    tinker_max_clients: int = Field(default=64, ge=1, description=MAX_CLIENTS_DESCRIPTION)
    # A job's push_to_hub is done by the trainer with these, never by the job (which sees no token).
    hub_endpoint: str | None = Field(default=None, json_schema_extra=unset_means(
        "`$HF_ENDPOINT`, else `https://huggingface.co`"), description=(
        "The Hugging Face Hub that jobs with `push_to_hub` are pushed to."))
    hub_token_file: Path | None = Field(default=None, json_schema_extra=unset_means(
        "`$HF_TOKEN` (or huggingface_hub's saved token)"), description=(
        "A file holding the Hub token jobs are pushed with (a mounted Kubernetes Secret); never "
        "passed to a job. With no token at all, a job asking for `push_to_hub` is refused (422)."))
    # The token is the operator's: what it may write is the operator's choice, not a training key's.
    hub_allowed_namespaces: str = Field(default="", description=(
        "The Hub users or organisations (comma-separated) a training key without `admin` may "
        "`push_to_hub` to; none by default, so only an admin key (or a gateway without keys) "
        "pushes. Others are refused at submission (422)."))
    hub_allow_public: bool = Field(default=False, description=(
        "Whether a job may create a public repo (`push_to_hub.private: false`); refused at "
        "submission (422) otherwise, for admin keys too."))
    hub_allow_existing_repos: bool = Field(default=False, description=(
        "Whether a job may push to a Hub repo that already exists and was not created by this "
        "trainer for the same key; otherwise such a push fails, saying so in the job's `hub`."))

    @property
    def hub_namespace_set(self) -> frozenset[str]:
        return frozenset(n.strip() for n in self.hub_allowed_namespaces.split(",") if n.strip())

    @property
    def jobs_dir(self) -> Path:
        return self.jobs_path or self.state_dir / "jobs"

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.state_dir / 'loopline.db').resolve()}"


class CheckpointWatcherSettings(CommonSettings):
    # Same variable and default as TrainerSettings.jobs_dir: it reads what the trainer wrote.
    jobs_path: Path | None = Field(default=None, validation_alias="LOOPLINE_JOBS_DIR",
                                   json_schema_extra=unset_means("`$LOOPLINE_STATE_DIR/jobs`"),
                                   description=JOBS_DIR_DESCRIPTION)
    # New checkpoints are noticed through inotify within ~10 ms; the rescan is the safety net for
    # events inotify cannot see (a volume written by another node over NFS, a full inotify queue).
    rescan_interval_s: float = Field(default=2.0, gt=0, description=(
        "How often every job is compared with the checkpoint cursor; where inotify never fires "
        "(NFS), this is the latency."))
    inotify: bool = Field(default=True, description=(
        "Notice new checkpoints through inotify; off, only the rescan does (shorten it then, e.g. 0.1)."))
    # Full-weight checkpoints of a large model do not belong in the message bus.
    max_adapter_bytes: int = Field(default=2 * GiB, gt=0, description=(
        "A checkpoint whose adapter file is larger is rejected."))

    @property
    def jobs_dir(self) -> Path:
        return self.jobs_path or self.state_dir / "jobs"


class TinkerWorkerSettings(CommonSettings):
    """A session worker's, written into its entrypoint by the trainer."""

    tinker_worker_id: str = Field(default="", description="The session worker's id (set by the trainer).")
    tinker_base_model: str = Field(default="", description=(
        "The served model the session worker trains adapters of (set by the trainer)."))
    tinker_model_path: str = Field(default="", description=(
        "The folder the session worker loads that model from (set by the trainer)."))
    jobs_path: Path | None = Field(default=None, validation_alias="LOOPLINE_JOBS_DIR",
                                   json_schema_extra=unset_means("`$LOOPLINE_STATE_DIR/jobs`"),
                                   description=JOBS_DIR_DESCRIPTION)
    tinker_idle_ttl_s: float = Field(default=1800.0, gt=0, description=(
        "A training client idle this long is released; the worker exits when none is left."))
    tinker_gap_timeout_s: float = Field(default=30.0, gt=0, description=(
        "How long a model's calls wait for a missing earlier `seq_id` before running without it."))
    tinker_announce_timeout_s: float = Field(default=120.0, gt=0, description=(
        "How long a sampler save waits for the checkpoint-watcher's announcement before failing."))
    heartbeat_s: float = Field(default=2.0, gt=0, description=(
        "How often the session worker records that it is alive."))
    tinker_shared_passes: bool | None = Field(default=None, description=SHARED_PASSES_DESCRIPTION)
    # The SDK cuts a call at ~5 MB of proto; dense, that is ~5 MB here. A sparse tensor is sized by
    # its shape, not its bytes: 400 KB of them once grew a shared worker by 7 GB.
    tinker_max_request_bytes: int = Field(default=256 * MiB, ge=1 * MiB,
                                          description=MAX_REQUEST_BYTES_DESCRIPTION)
    # Each client is a LoRA of every adapted layer and its AdamW state, resident in the worker.
    tinker_max_clients: int = Field(default=64, ge=1, description=MAX_CLIENTS_DESCRIPTION)

    @property
    def jobs_dir(self) -> Path:
        return self.jobs_path or self.state_dir / "jobs"


class StackSettings(CommonSettings):
    """The embedded default started by ``make up``."""

    host: str = Field(default="127.0.0.1", description="Where the gateway listens.")
    port: int = Field(default=8000, description="The gateway's HTTP port.")
    nats_port: int = Field(default=4222, description="The embedded nats-server's client port.")
    nats_monitor_port: int = Field(default=8222, description="The embedded nats-server's monitoring port.")
    model: str = Field(default=DEFAULT_MODEL, description=(
        "the models `make up` prepares and serves, comma-separated (`tiny,tiny-embed`): a deployment "
        "each, the first the default; `LOOPLINE_<SETTING>__<MODEL KEY>` sets an inference setting "
        "for one of them (`LOOPLINE_VLLM_ARGS__TINY_EMBED`; the key: the model in upper case, other "
        "characters `_`)"))
    inference_replicas: int = Field(default=1, description=(
        "Inference processes to start per model (`LOOPLINE_INFERENCE_REPLICAS__<MODEL KEY>` for one)."))
    # What the stack gives its trainer and checkpoint-watcher, and where it finds the local runs
    # it stops at the end: the stack must know it, not only pass it on.
    jobs_path: Path | None = Field(default=None, validation_alias="LOOPLINE_JOBS_DIR",
                                   json_schema_extra=unset_means("`$LOOPLINE_STATE_DIR/jobs`"),
                                   description=JOBS_DIR_DESCRIPTION)
