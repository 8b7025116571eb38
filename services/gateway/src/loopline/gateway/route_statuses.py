"""What the gateway's own routes answer besides 200, and why: the statuses its OpenAPI document lists
(openapi_docs.install puts them in), in one place, so a reader sees every route's errors at once.

401 and 413 are the middleware's (api_keys.py, body_limit.py) and are added to every route there;
vLLM's relayed routes are documented by openapi_docs.route_docs. tests/gateway/test_openapi.py
checks that every route of the app has its entry here, and the fuzz run (tests/e2e/test_fuzz.py)
that no route answers a status missing from it.
"""

from __future__ import annotations

from typing import Any

# How the non-OpenAI routes answer an error (errors.py): FastAPI's and ScalarLM's shape.
GATEWAY_ERROR = {"type": "object", "title": "GatewayError", "required": ["detail"],
                 "properties": {"detail": {"type": "string", "title": "Detail"}}}

NOT_JSON = "the body is not valid JSON"
FIELDS = "a field, query parameter or header is missing or of the wrong type (the message names it)"
MODEL = "no such model, or a job that is not deployed (the message says which and why)"
FULL = "the deployment's queue is full (admission): retry after `Retry-After`"
BUS = ("the message bus did not take the request, or no replica has served the model for "
       "`LOOPLINE_REPLICA_GRACE_S`: retry after `Retry-After`")
TRAINER = {
    502: "the trainer answered with something that is not its API",
    503: "no trainer is running, or it cannot reach Slurm or the datasets store: retry",
    504: "the trainer did not answer in time",
}
QUEUE = {
    502: "the queue service answered with something that is not its API",
    503: "no queue service is running, or the message bus is unavailable: retry after `Retry-After`",
    504: "the queue service did not answer in time",
}
JOB = {404: "no such job", 422: "the job name is ambiguous (a prefix of several jobs) or empty"}
ARCHIVE = {
    400: "the archive cannot be read, holds an unsafe path, or `params` is not JSON",
    403: "the archive ships its own `ml/` code and this trainer does not run user code",
    413: "the archive or its dataset is larger than the limits",
    422: "`params` is not valid train_args (the message names the field), or the dataset is invalid",
}

# (method, path template) -> {status: why}; the 200 is FastAPI's, from the route's response model.
ROUTES: dict[tuple[str, str], dict[int, str]] = {
    ("GET", "/v1/models"): {},
    ("GET", "/v1/health"): {},
    ("GET", "/v1/health/keepalive"): {},
    ("GET", "/metrics"): {},
    ("POST", "/v1/generate"): {
        400: f"{NOT_JSON}; no prompts; a prompt that is neither text nor messages; tools with text "
             "prompts; max_tokens beyond the model's context",
        404: MODEL, 413: "more prompts than `LOOPLINE_MAX_PROMPTS_PER_REQUEST`: use /v1/generate/upload",
        422: FIELDS, 429: FULL, 503: BUS},
    ("POST", "/v1/generate/get_results"): {
        400: f"{NOT_JSON}; no request ids; a malformed request id", 404: "no request with these ids",
        422: FIELDS},
    ("POST", "/v1/generate/upload"): {
        400: "the file is not a JSON array of requests, or a request is malformed", 404: MODEL,
        413: "the file is larger than `LOOPLINE_MAX_UPLOAD_BYTES`", 422: FIELDS, 429: FULL, 503: BUS},
    ("POST", "/v1/generate/download"): {400: NOT_JSON, 404: "no uploaded batch with this id", 422: FIELDS},
    ("GET", "/v1/generate/metrics"): QUEUE,
    ("POST", "/v1/generate/clear_queue"): QUEUE,
    ("POST", "/v1/megatron/train"): {**ARCHIVE, 400: f"no `file` part; {ARCHIVE[400]}", **TRAINER},
    ("GET", "/v1/megatron/train/{job}"): {**JOB, **TRAINER},
    ("GET", "/v1/megatron/list_models"): TRAINER,
    ("POST", "/v1/megatron/cancel/{job}"): {**JOB, 409: "the job is over already", **TRAINER},
    ("POST", "/v1/megatron/delete/{job}"): {**JOB, **TRAINER},
    ("POST", "/v1/megatron/restart/{job}"): {
        **JOB, 409: "only a failed or cancelled job restarts, once its previous run has stopped", **TRAINER},
    ("GET", "/v1/megatron/squeue"): TRAINER,
    ("GET", "/v1/megatron/gpu_count"): TRAINER,
    ("GET", "/v1/megatron/node_count"): TRAINER,
    ("GET", "/v1/megatron/train/logs/{job}"): {**JOB, 422: f"{JOB[422]}; {FIELDS}", **TRAINER},
    ("GET", "/v1/megatron/train/{job}/events"): {**JOB, **TRAINER},
    ("GET", "/v1/megatron/events"): {503: "the message bus is unavailable: retry"},
    ("GET", "/v1/tinker/events"): {422: FIELDS, 503: "the message bus is unavailable: retry"},
    ("GET", "/v1/tinker/workers/{worker_id}/events"): {
        404: "no such session worker", 422: FIELDS, 503: "the message bus is unavailable: retry"},
    ("GET", "/v1/tinker/runs/{run_id}/events"): {
        404: "no such training run", 409: "the run is not on a session worker yet: retry",
        422: FIELDS, 503: "the message bus is unavailable: retry"},
    ("POST", "/v1/megatron/upload/init"): {
        400: NOT_JSON, 413: "the upload or its chunks are larger than the limits",
        422: f"{FIELDS}; the chunk count does not match the sizes; invalid `params`"},
    ("POST", "/v1/megatron/upload/chunk"): {
        400: "a header is missing, or the chunk index or length does not fit the upload",
        404: "no such upload: unknown, finished or expired", 413: "the chunk is larger than the limit",
        422: "the chunk's sha256 is not its `X-Chunk-Hash`: send it again"},
    ("POST", "/v1/megatron/upload/finalize"): {
        **ARCHIVE, 400: f"{NOT_JSON}; {ARCHIVE[400]}", 404: "no such upload: unknown, finished or expired",
        409: "chunks are missing: send them, then finalize again",
        422: f"{FIELDS}; the assembled upload is not what init declared; {ARCHIVE[422]}", **TRAINER},
}

# The Tinker API (/api/v1, for the tinker SDK): its 400s name the field; the SDK fails fast on a 4xx
# other than 408/409/429 and retries those and 5xx.
TINKER_BODY = "the body is not the SDK's request (the message names the field), or not JSON"
TINKER_MODEL = "no such training client (model_id)"
TINKER_CALL = {400: TINKER_BODY, 404: TINKER_MODEL, 429: "the Tinker call queue is full: retry later",
               503: "the message bus did not take the call: retry"}
TINKER_SESSION = {410: "no such session (the SDK stops its heartbeat)"}
ROUTES.update({
    ("POST", "/api/v1/client/config"): {},
    ("POST", "/api/v1/create_session"): {400: TINKER_BODY},
    ("POST", "/api/v1/session_heartbeat"): {400: TINKER_BODY, **TINKER_SESSION},
    ("POST", "/api/v1/sessions/{session_id}/finish"): {400: TINKER_BODY, **TINKER_SESSION},
    ("POST", "/api/v1/telemetry"): {},
    ("POST", "/api/v1/create_model"): {
        400: f"{TINKER_BODY}; no lora_config; an optimizer other than AdamW; a rank above the largest "
             "served", 404: "the base model is not served here", **TINKER_SESSION, **TRAINER},
    ("POST", "/api/v1/get_info"): {400: TINKER_BODY, 404: TINKER_MODEL},
    ("POST", "/api/v1/forward_backward"): {
        **TINKER_CALL, 400: "not a ForwardBackwardRequest, or its zstd does not decode",
        415: "the body is not protobuf (application/x-protobuf)"},
    ("POST", "/api/v1/optim_step"): {**TINKER_CALL, 400: f"{TINKER_BODY}; optimizer_params (only AdamW)"},
    ("POST", "/api/v1/save_weights_for_sampler"): {
        **TINKER_CALL, 400: f"{TINKER_BODY}; a kind other than snapshot; a bad checkpoint name"},
    ("POST", "/api/v1/save_weights"): {**TINKER_CALL, 400: f"{TINKER_BODY}; a bad checkpoint name"},
    ("POST", "/api/v1/load_weights"): {
        **TINKER_CALL, 400: f"{TINKER_BODY}; not a tinker path of this server",
        404: f"{TINKER_MODEL}, or no such checkpoint", **TINKER_SESSION, **TRAINER},
    ("POST", "/api/v1/retrieve_future"): {400: TINKER_BODY, 404: "no such future"},
    ("POST", "/api/v1/create_sampling_session"): {
        400: f"{TINKER_BODY}; not a sampler_weights path", 404: "no such checkpoint or base model"},
    ("GET", "/api/v1/samplers/{sampler_id}"): {404: "no such sampling session"},
    ("POST", "/api/v1/asample"): {
        400: f"{TINKER_BODY}; a sampling option this server cannot honour (the message names it)",
        404: "no such sampling session, checkpoint or base model", 429: FULL, 503: BUS},
    ("GET", "/api/v1/training_runs"): {422: FIELDS},
    ("GET", "/api/v1/training_runs/{run_id}"): {404: "no such training run"},
    ("GET", "/api/v1/training_runs/{run_id}/checkpoints"): {404: "no such training run"},
    ("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"): {
        400: "the kind is not weights or sampler_weights", 404: "no such checkpoint"},
    ("POST", "/api/v1/weights_info"): {400: f"{TINKER_BODY}; not a tinker path", 404: "no such checkpoint"},
    ("GET", "/api/v1/sessions"): {422: FIELDS},
    ("GET", "/api/v1/sessions/{session_id}"): {404: "no such session"},
    ("GET", "/api/v1/get_server_capabilities"): {},
    ("GET", "/api/v1/healthz"): {},
})

# Routes whose 200 is not one JSON body (a stream of lines, Prometheus text): its media type.
MEDIA_TYPES = {
    ("GET", "/v1/megatron/train/logs/{job}"): "text/event-stream",
    ("GET", "/v1/megatron/train/{job}/events"): "text/event-stream",
    ("GET", "/v1/megatron/events"): "text/event-stream",
    ("GET", "/v1/tinker/events"): "text/event-stream",
    ("GET", "/v1/tinker/workers/{worker_id}/events"): "text/event-stream",
    ("GET", "/v1/tinker/runs/{run_id}/events"): "text/event-stream",
    ("GET", "/metrics"): "text/plain",
}

# Bodies the routes read themselves (so FastAPI cannot describe them): their openapi_extra.
TRAIN_FORM = {"type": "object", "required": ["file"], "properties": {
    "file": {"type": "string", "format": "binary",
             "description": "tar(.gz) with dataset.jsonlines and optionally ml/"},
    "params": {"type": "string", "description": "train_args as a JSON object"}}}
TRAIN_BODY: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": TRAIN_FORM}}}}
CHUNK_BODY: dict[str, Any] = {
    "parameters": [{"name": name, "in": "header", "required": True, "schema": {"type": "string"},
                    "description": why}
                   for name, why in (("X-Upload-Id", "what init answered"),
                                     ("X-Chunk-Index", "the chunk's position, from 0"),
                                     ("X-Chunk-Hash", "the chunk's sha256, in hex"))],
    "requestBody": {"required": True, "content": {"application/octet-stream": {
        "schema": {"type": "string", "format": "binary"}}}}}
