"""The gateway's OpenAPI document as a real gateway process serves it: vLLM's own request bodies on the
relayed routes (vllm_openapi.json, which must be what the installed vLLM documents), every other
route's statuses and API-key scope as it declares them where it is defined (route_spec.declare), the
middleware's 401, 403 (a cross-site browser request) and 413, and no dangling reference.
Whether the routes answer only what is listed is the fuzz run's job (tests/e2e/test_fuzz.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from loopline.common.contracts.schemas import QUEUED_ROUTES
from loopline.common.local import launcher
from loopline.gateway.app import ROUTERS
from loopline.gateway.auth.same_origin import SAFE_METHODS
from loopline.gateway.auth.scopes import ANY_KEY, OPEN, SCOPES
from loopline.gateway.core.openapi_docs import STATUSES, VLLM_OPENAPI, vllm_document
from loopline.gateway.core.route_spec import SCOPE
from support.gateway_process import start_gateway


def served_document(nats_url: str, state, **env: str) -> dict:
    gateway = start_gateway(nats_url, state, **env)
    try:
        resp = httpx.get(f"{gateway.url}/openapi.json", timeout=30)
        assert resp.status_code == 200, resp.text
        return resp.json()
    finally:
        launcher.stop(gateway.proc)


@pytest.fixture(scope="module")
def document(nats_proc, tmp_path_factory) -> dict:
    return served_document(nats_proc.info["url"], tmp_path_factory.mktemp("plain"))


def operations(document: dict) -> dict[tuple[str, str], dict]:
    return {(method.upper(), path): operation for path, methods in document["paths"].items()
            for method, operation in methods.items()}


# Tier: builds vLLM's app in a fresh interpreter, ~9 s.
@pytest.mark.slow
def test_vllm_openapi_json_is_what_the_installed_vllm_documents():
    vllm = pytest.importorskip("vllm")
    written_by = json.loads(VLLM_OPENAPI.read_text())["vllm"]
    if vllm.__version__ != written_by:
        pytest.skip(f"{VLLM_OPENAPI.name} was written with vLLM {written_by}; this is {vllm.__version__}")
    # The documented command, in its own process: vLLM's import sets up logging and threads.
    run = subprocess.run([sys.executable, "-m", "loopline.gateway.core.openapi_docs"], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, (f"{run.stdout}\n{run.stderr[-2000:]}\nrun `python -m "
                                 "loopline.gateway.core.openapi_docs --write` and commit the file")


def test_relayed_routes_take_vllms_request_bodies(document):
    ops = operations(document)
    vllm = vllm_document()
    for path in QUEUED_ROUTES:
        operation = ops["POST", path]
        assert operation["requestBody"] == vllm["paths"][path]["requestBody"], path
        statuses = {int(s) for s in operation["responses"]}
        assert statuses >= set(STATUSES) | {403, 413}, path  # 403: a browser page of another origin
        assert 500 not in statuses and 401 not in statuses, path  # no API keys on this gateway
    assert ops["POST", "/v1/chat/completions"]["requestBody"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/ChatCompletionRequest"}


def declared_statuses() -> dict[tuple[str, str], set[int]]:
    """What each route of the surfaces declares besides 200, read off the routes themselves."""
    return {(method, route.path): {int(s) for s in route.responses} - {200}
            for router in ROUTERS
            for route in router.routes if route.path not in QUEUED_ROUTES for method in route.methods}


def test_every_other_route_lists_the_statuses_it_answers(document):
    ops = operations(document)
    own = {key: op for key, op in ops.items() if key[1] not in QUEUED_ROUTES}
    declared = declared_statuses()
    assert set(own) == set(declared) | {("GET", "/metrics")}
    for key, operation in own.items():
        statuses = {int(s) for s in operation["responses"]}
        # This gateway listens on 127.0.0.1: a browser may be refused any operation by DNS rebinding,
        # and every method that can change state as cross-site (auth/same_origin.py).
        assert statuses == {200, 403, 413, *declared.get(key, ())}, key
        refused = operation["responses"]["403"]["description"]
        assert "DNS rebinding" in refused, key
        assert ("LOOPLINE_ALLOWED_ORIGINS" in refused) == (key[0] not in SAFE_METHODS), key
        assert all(answer["content"] for answer in operation["responses"].values()), key
    assert {int(s) for s in ops["POST", "/v1/generate"]["responses"]} == {
        200, 400, 403, 404, 413, 422, 429, 503}
    # A declared media type replaces FastAPI's JSON: a stream of lines, Prometheus text.
    assert list(ops["GET", "/v1/megatron/events"]["responses"]["200"]["content"]) == ["text/event-stream"]
    assert list(ops["GET", "/metrics"]["responses"]["200"]["content"]) == ["text/plain"]
    # The bodies the routes read themselves are described too.
    train = ops["POST", "/v1/megatron/train"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert train["required"] == ["file"]
    chunk = ops["POST", "/v1/megatron/upload/chunk"]
    assert {p["name"] for p in chunk["parameters"]} == {"X-Upload-Id", "X-Chunk-Index", "X-Chunk-Hash"}


def test_every_route_declares_a_scope(document):
    # A route added without **declare(scope, ...) fails here.
    scopes = {key: operation.get(SCOPE) for key, operation in operations(document).items()}
    assert set(scopes.values()) <= {*SCOPES, OPEN, ANY_KEY}, {k: s for k, s in scopes.items() if s is None}
    assert scopes["GET", "/v1/health/keepalive"] == scopes["GET", "/metrics"] == OPEN
    assert scopes["POST", "/v1/chat/completions"] == "inference"
    assert scopes["POST", "/v1/megatron/delete/{job}"] == "admin"


def test_errors_are_documented_in_the_shape_they_are_answered_in(document, nats_proc):
    ops = operations(document)
    assert ops["POST", "/v1/completions"]["responses"]["429"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/ErrorResponse"}  # vLLM's, OpenAI's shape
    download = ops["POST", "/v1/generate/download"]["responses"]["422"]
    assert download["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/GatewayError"}
    # Every reference resolves: vLLM's schemas came along with its bodies.
    schemas = document["components"]["schemas"]
    refs = set()
    todo: list = [document["paths"], schemas]
    # Invariant: every node taken off todo has had its children put on it.
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.add(node["$ref"].rpartition("/")[2])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    assert refs and refs <= set(schemas), refs - set(schemas)


def test_with_api_keys_every_keyed_route_lists_401_403_and_429(nats_proc, tmp_path):
    document = served_document(nats_proc.info["url"], tmp_path, LOOPLINE_API_KEYS="a-key")
    for (method, path), operation in operations(document).items():
        need = operation[SCOPE]
        responses = operation["responses"]
        # An open route may answer a 401 or 429 of its own (the dashboard's sign-in refusing a key,
        # or one key's sign-ins past LOOPLINE_MAX_UI_SESSIONS_PER_KEY), never the keys'.
        keys_401 = "401" in responses and "API keys are on" in responses["401"]["description"]
        keys_429 = "429" in responses and "over its request rate" in responses["429"]["description"]
        assert keys_401 == (need != OPEN), (method, path)
        assert ("429" in responses) if need != OPEN else not keys_429, (method, path)
        # Every one: a key's scope, a cross-site page, or (on 127.0.0.1) a rebound one (test above).
        assert "403" in responses, (method, path)
