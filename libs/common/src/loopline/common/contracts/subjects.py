"""Every NATS subject, stream, bucket and durable name Loopline uses, in one place.

Services never spell a subject by hand: they call these functions, so a rename is one edit and a
typo is an AttributeError instead of a message sent into the void.
"""

from __future__ import annotations

import hashlib
import re

# --- streams -------------------------------------------------------------------------------------
WORK_STREAM = "WORK"
RESULTS_STREAM = "RESULTS"
EVENTS_STREAM = "EVENTS"
# JetStream advisories we must not miss while the queue service is down (dead letters).
ADVISORIES_STREAM = "ADVISORIES"

# Latest checkpoint per job: deliver-last-per-subject lets a new replica catch up.
CHECKPOINTS_STREAM = "CHECKPOINTS"

# --- object stores -------------------------------------------------------------------------------
# Uploaded training data (and a job's own ml/ code), named by the sha256 of the *uncompressed* bytes.
DATASETS_BUCKET = "datasets"
# Adapter checkpoints, named by content hash (checkpoint-watcher writes, inference reads).
ADAPTERS_BUCKET = "adapters"
# ScalarLM's chunked training uploads in progress: ``<upload id>/plan`` and ``<upload id>/<index>``,
# kept for the gateway's upload_ttl_s, so any gateway takes any chunk and any finalizes.
UPLOADS_BUCKET = "uploads"

# --- key-value buckets ---------------------------------------------------------------------------
# deployment key -> DeploymentInfo (written by inference replicas, watched by the gateway)
MODELS_BUCKET = "MODELS"
# batch group id -> BatchManifest (written by the gateway once all of the batch's work is stored)
BATCHES_BUCKET = "BATCHES"
# job hash -> the checkpoint-watcher's cursor for that job (what it announced, rejected, skipped)
CHECKPOINT_CURSOR_BUCKET = "CHECKPOINT_CURSOR"
# SHA-256 of a dashboard session id -> the API key (its SHA-256) it signed in with and when it
# ends; the gateway's own bucket, its TTL the session's lifetime (gateway auth/ui_sessions.py)
UI_SESSIONS_BUCKET = "UI_SESSIONS"

# --- durable consumers ---------------------------------------------------------------------------
LEDGER_WORK_DURABLE = "ledger-work"
LEDGER_RESULTS_DURABLE = "ledger-results"
DEAD_LETTERS_DURABLE = "dead-letters"


def inference_durable(deployment: str) -> str:
    """The one durable pull consumer that every replica of a deployment shares."""
    return f"inference-{deployment}"


# --- work ----------------------------------------------------------------------------------------
WORK_ALL = "work.generate.>"


def work(deployment: str) -> str:
    return f"work.generate.{deployment}"


# --- results -------------------------------------------------------------------------------------
RESULTS_ALL = "results.>"


def result(group: str, index: int) -> str:
    return f"results.{group}.{index}"


def results_of_group(group: str) -> str:
    return f"results.{group}.*"


# --- answers to one gateway (core NATS, not stored) --------------------------------------------------
# A result also goes, at once, to the subject its work item names in ``reply_to``: the gateway that
# holds the client's connection listens on all of its own with one subscription, instead of
# subscribing and unsubscribing per request. The stored copy on ``results.*`` stays the record.
def gateway_answers(gateway: str) -> str:
    return f"answers.{gateway}.*"


def answer(gateway: str, group: str) -> str:
    return f"answers.{gateway}.{group}"


# --- answer streams and cancels (core NATS, not stored) -------------------------------------------
def token_stream(request_id: str) -> str:
    """A streamed answer's events, as the replica's vLLM makes them."""
    return f"stream.{request_id}"


# A gateway whose client went away says so here; the replica serving the request then tells vLLM
# its client disconnected, and vLLM aborts the generation, as `vllm serve` does for its own clients.
CANCELS = "cancel.*"


def cancel(request_id: str) -> str:
    return f"cancel.{request_id}"


# --- queue state, published by the queue service for admission control ----------------------------
QUEUE_STATE = "queue.state"

# --- events --------------------------------------------------------------------------------------
EVENTS_ALL = "events.>"
JOB_EVENTS_ALL = "events.jobs.>"
# "hub" comes after "completed", when the trainer has pushed the job to the Hub (or failed to).
JOB_EVENT_KINDS = ("queued", "started", "progress", "checkpoint", "completed", "failed", "cancelled", "hub")


def job_event(job_hash: str, kind: str) -> str:
    """``events.jobs.<hash>.<kind>``: what a user following a training job subscribes to."""
    return f"events.jobs.{job_hash}.{kind}"


def job_events(job_hash: str) -> str:
    return f"events.jobs.{job_hash}.*"


ADAPTER_EVENTS_ALL = "events.adapters.>"
ADAPTER_EVENT_KINDS = ("rejected", "loaded", "retired")


def adapter_event(job_hash: str, kind: str) -> str:
    """``events.adapters.<hash>.<kind>``: a checkpoint rejected by the watcher, loaded by a replica,
    or every checkpoint of a deleted job retired (adapter_retire.py)."""
    return f"events.adapters.{job_hash}.{kind}"


def adapter_events(job_hash: str) -> str:
    return f"events.adapters.{job_hash}.*"


def job_story(job_hash: str) -> str:
    """A job's events and its adapter's (``events.jobs.<hash>.*`` and ``events.adapters.<hash>.*``):
    what it did and whether a replica serves it. No other EVENTS subject has a job hash there."""
    return f"events.*.{job_hash}.*"


# What inference replicas follow to unload the adapters of deleted jobs.
ADAPTER_RETIREMENTS = "events.adapters.*.retired"


# --- checkpoints ----------------------------------------------------------------------------------
CHECKPOINTS_ALL = "checkpoints.>"


def checkpoint_subject(base: str, job_hash: str) -> str:
    """``checkpoints.<base>.<hash>``: the latest checkpoint of a job that adapts the model ``base``
    (its served name, the job's ``llm_name``); the stream keeps the last message per subject."""
    return f"checkpoints.{deployment_key(base)}.{job_hash}"


def checkpoints_of_job(job_hash: str) -> str:
    """Every checkpoint subject of one job, whatever model it adapts (what deleting it purges)."""
    return f"checkpoints.*.{job_hash}"


def checkpoints_of_base(base: str) -> str:
    """What an inference replica serving ``base`` subscribes to (deliver last per subject)."""
    return f"checkpoints.{deployment_key(base)}.*"


# --- JetStream advisories ------------------------------------------------------------------------
def max_deliveries_advisory(stream: str = WORK_STREAM, consumer: str = "*") -> str:
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"


# --- Tinker API: step-level training sessions ---------------------------------------------------
# Each session worker (one resident base model, many LoRA training clients) reads its calls from
# ``tinker.calls.<worker>``: work-queue retention, so what is left there is what it has not done.
TINKER_CALLS_STREAM = "TINKER_CALLS"
TINKER_CALLS_ALL = "tinker.calls.>"
# One message per training future (``tinker.futures.<request id>``): the result the worker made,
# read by any gateway with get-last-by-subject, and heard at once by a gateway long-polling it.
TINKER_FUTURES_STREAM = "TINKER_FUTURES"
TINKER_FUTURES_ALL = "tinker.futures.>"
# Bodies and results too large for one NATS message (a forward_backward chunk may be 5 MB).
TINKER_BLOBS_BUCKET = "tinker-blobs"
# session id -> TinkerSession; model key -> TinkerModel; worker id -> TinkerWorker;
# sampling session id -> TinkerSampler; checkpoint key -> TinkerCheckpoint.
TINKER_SESSIONS_BUCKET = "TINKER_SESSIONS"
TINKER_MODELS_BUCKET = "TINKER_MODELS"
TINKER_WORKERS_BUCKET = "TINKER_WORKERS"
TINKER_SAMPLERS_BUCKET = "TINKER_SAMPLERS"
TINKER_CHECKPOINTS_BUCKET = "TINKER_CHECKPOINTS"


def tinker_calls(worker_id: str) -> str:
    """What one session worker consumes, in the order the gateway published it."""
    return f"tinker.calls.{worker_id}"


def tinker_future(request_id: str) -> str:
    return f"tinker.futures.{request_id}"


def tinker_sample_request(request_id: str) -> str:
    """The SDK's sample request, kept beside its future: what its vLLM answer is turned into."""
    return f"tinker.futures.{request_id}.request"


def tinker_sample_record(request_id: str) -> str:
    """A sample request's SampledRecord (record_stability_info), kept as long as its future."""
    return f"tinker.futures.{request_id}.record"


def tinker_calls_durable(worker_id: str) -> str:
    return f"tinker-worker-{worker_id}"


SESSION_EVENTS_ALL = "events.sessions.>"
SESSION_EVENT_KINDS = ("created", "step", "saved", "released", "failed", "metrics")


def session_event(worker_id: str, kind: str) -> str:
    """``events.sessions.<worker>.<kind>``: a session worker's models created, stepped, saved,
    released, or the worker failed."""
    return f"events.sessions.{worker_id}.{kind}"


# --- request-reply services (nats.micro) -----------------------------------------------------------
QUEUE_SERVICE = "loopline-queue"
INFERENCE_SERVICE = "loopline-inference"
TRAINER_SERVICE = "loopline-trainer"
CHECKPOINT_WATCHER_SERVICE = "loopline-checkpoint-watcher"
GATEWAY_SERVICE = "loopline-gateway"

SVC_QUEUE_METRICS = "svc.queue.metrics"
SVC_QUEUE_CLEAR = "svc.queue.clear"
SVC_QUEUE_STATUS = "svc.queue.status"
SVC_INFERENCE_STATUS = "svc.inference.status"
# The trainer's request-reply API (wire types in job_schemas.py). Errors come back through
# nats.micro's error headers with an HTTP status as the code ("404", "409", "403", "422").
SVC_TRAINER_SUBMIT = "svc.trainer.submit"      # JobSubmit -> JobInfo
SVC_TRAINER_GET = "svc.trainer.get"            # JobRef -> JobInfo
SVC_TRAINER_LIST = "svc.trainer.list"          # {} -> JobList
SVC_TRAINER_CANCEL = "svc.trainer.cancel"      # JobRef -> JobInfo
SVC_TRAINER_DELETE = "svc.trainer.delete"      # JobRef -> JobInfo
SVC_TRAINER_RESTART = "svc.trainer.restart"    # JobRef -> JobInfo (409 unless FAILED/CANCELLED)
SVC_TRAINER_LOGS = "svc.trainer.logs"          # LogsRequest -> LogLines
SVC_TRAINER_SQUEUE = "svc.trainer.squeue"      # JobListRequest -> SqueueReply
SVC_TRAINER_CLUSTER = "svc.trainer.cluster"    # {} -> ClusterInfo
SVC_TRAINER_STATUS = "svc.trainer.status"      # {} -> ServiceStatus
# Tinker: a training client's model placed on a session worker (started when none serves its base).
SVC_TRAINER_TINKER_PLACE = "svc.trainer.tinker_place"      # PlaceModel -> TinkerModel
SVC_TRAINER_TINKER_WORKERS = "svc.trainer.tinker_workers"  # {} -> TinkerWorkerList
SVC_CHECKPOINT_WATCHER_STATUS = "svc.checkpoint_watcher.status"  # {} -> ServiceStatus
SVC_GATEWAY_STATUS = "svc.gateway.status"      # {} -> ServiceStatus

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def deployment_key(model_name: str) -> str:
    """A subject-safe, stable token for a served model name.

    Model names hold slashes and dots (``HuggingFaceTB/SmolLM2-135M-Instruct``, ``/data/tiny``),
    which NATS treats as separators, so we keep a readable slug and add a short hash so two names
    that slug the same still get different subjects.
    """
    slug = _UNSAFE.sub("-", model_name).strip("-")[-40:] or "model"
    digest = hashlib.sha256(model_name.encode()).hexdigest()[:8]
    return f"{slug}-{digest}"
