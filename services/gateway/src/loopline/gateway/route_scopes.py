"""Which API-key scope each gateway route needs, in one place beside route_statuses.ROUTES
(tests/gateway/test_openapi.py checks that every route of the app has its entry here).

A key holds some of ``inference``, ``training`` and ``admin``; ``admin`` holds the other two as well.
Two levels need no scope: ``open`` routes need no key at all (container health probes), ``any key``
routes need a valid key of any scope (the Tinker SDK's session housekeeping, which a sampling client
and a training client both do). Cancelling or restarting a job is ``training`` here; the route
itself then lets a key without ``admin`` act only on the jobs it submitted (train_api.py).
"""

from __future__ import annotations

from loopline.common.schemas import QUEUED_ROUTES

INFERENCE = "inference"
TRAINING = "training"
ADMIN = "admin"
SCOPES = (INFERENCE, TRAINING, ADMIN)  # what a key can be given
OPEN = "open"
ANY_KEY = "any key"

# (method, path template) -> what a key needs to call it. vLLM's relayed routes (the OpenAI API:
# completions, chat, embeddings, ...) are all inference.
ROUTE_SCOPES: dict[tuple[str, str], str] = {("POST", path): INFERENCE for path in QUEUED_ROUTES}
ROUTE_SCOPES.update({
    ("GET", "/v1/health/keepalive"): OPEN,
    ("GET", "/metrics"): OPEN,  # outside /v1; also on the metrics port, which has no keys
    ("GET", "/v1/health"): ANY_KEY,  # the scalarlm client checks it before anything else
    ("GET", "/v1/models"): INFERENCE,
    # ScalarLM's inference: batches in, results polled.
    ("POST", "/v1/generate"): INFERENCE,
    ("POST", "/v1/generate/get_results"): INFERENCE,
    ("POST", "/v1/generate/upload"): INFERENCE,
    ("POST", "/v1/generate/download"): INFERENCE,
    # Operational: the queue's depth of every deployment, and emptying it for everyone.
    ("GET", "/v1/generate/metrics"): ADMIN,
    ("POST", "/v1/generate/clear_queue"): ADMIN,
    # ScalarLM's training.
    ("POST", "/v1/megatron/train"): TRAINING,
    ("GET", "/v1/megatron/train/{job}"): TRAINING,
    ("GET", "/v1/megatron/list_models"): TRAINING,
    ("POST", "/v1/megatron/cancel/{job}"): TRAINING,  # its own jobs; admin any (train_api.py)
    ("POST", "/v1/megatron/restart/{job}"): TRAINING,  # likewise
    ("POST", "/v1/megatron/delete/{job}"): ADMIN,
    ("GET", "/v1/megatron/squeue"): TRAINING,
    ("GET", "/v1/megatron/gpu_count"): TRAINING,
    ("GET", "/v1/megatron/node_count"): TRAINING,
    ("GET", "/v1/megatron/train/logs/{job}"): TRAINING,
    ("GET", "/v1/megatron/train/{job}/events"): TRAINING,
    ("GET", "/v1/megatron/events"): TRAINING,
    ("POST", "/v1/megatron/upload/init"): TRAINING,
    ("POST", "/v1/megatron/upload/chunk"): TRAINING,
    ("POST", "/v1/megatron/upload/finalize"): TRAINING,
    ("GET", "/v1/tinker/events"): TRAINING,
    ("GET", "/v1/tinker/workers/{worker_id}/events"): TRAINING,
    ("GET", "/v1/tinker/runs/{run_id}/events"): TRAINING,
    # The Tinker API: sessions are everyone's, sampling is inference, the rest training.
    ("GET", "/api/v1/healthz"): OPEN,
    ("POST", "/api/v1/client/config"): ANY_KEY,
    ("POST", "/api/v1/create_session"): ANY_KEY,
    ("POST", "/api/v1/session_heartbeat"): ANY_KEY,
    ("POST", "/api/v1/sessions/{session_id}/finish"): ANY_KEY,
    ("POST", "/api/v1/telemetry"): ANY_KEY,
    ("GET", "/api/v1/get_server_capabilities"): ANY_KEY,
    ("POST", "/api/v1/retrieve_future"): ANY_KEY,  # a sample's future and a training step's alike
    ("POST", "/api/v1/create_sampling_session"): INFERENCE,
    ("GET", "/api/v1/samplers/{sampler_id}"): INFERENCE,
    ("POST", "/api/v1/asample"): INFERENCE,
    ("POST", "/api/v1/create_model"): TRAINING,
    ("POST", "/api/v1/get_info"): TRAINING,
    ("POST", "/api/v1/forward_backward"): TRAINING,
    ("POST", "/api/v1/optim_step"): TRAINING,
    ("POST", "/api/v1/save_weights_for_sampler"): TRAINING,
    ("POST", "/api/v1/save_weights"): TRAINING,
    ("POST", "/api/v1/load_weights"): TRAINING,
    ("GET", "/api/v1/training_runs"): TRAINING,
    ("GET", "/api/v1/training_runs/{run_id}"): TRAINING,
    ("GET", "/api/v1/training_runs/{run_id}/checkpoints"): TRAINING,
    ("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"): TRAINING,
    ("POST", "/api/v1/weights_info"): TRAINING,
    ("GET", "/api/v1/sessions"): TRAINING,
    ("GET", "/api/v1/sessions/{session_id}"): TRAINING,
})


def allows(scopes: frozenset[str], need: str) -> bool:
    """Whether a key holding ``scopes`` may call a route that needs ``need``."""
    return need in (OPEN, ANY_KEY) or ADMIN in scopes or need in scopes
