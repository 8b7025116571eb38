"""Scoped API keys from a keys file on a real gateway process (and the real trainer, for jobs and
their owners): each route family refuses a key without its scope with 403 in its clients' error
shape and lets the right one through to its route's own answer (a 2xx, or the 404 of a model not
served here: never any status but the expected one); the file holds hashes only; the plain
``LOOPLINE_API_KEYS`` still holds every scope; a key without ``admin`` controls only the jobs it
submitted (another's is a 404, as an unknown job: test_tenancy.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from loopline.common.contracts.job_layout import DATASET_FILE
from loopline.common.local import launcher
from loopline.gateway.auth.key_store import KeyEntry, KeyFile, key_hash, new_key, write_key_file
from support.gateway_process import BASE_MODEL, start_gateway, wait_job
from support.training_data import EXAMPLES, archive, jsonlines

PLAIN_KEY = "plain-compat-key"
# The stand-in "loads its model" this long before it writes anything: the job stays QUEUED.
LOADING = {"standin_start_s": 120}
KEYS = {name: new_key() for name in ("infer", "train", "train2", "boss")}
SCOPES = {"infer": ["inference"], "train": ["training"], "train2": ["training"], "boss": ["admin"]}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api_keys.json"
    write_key_file(path, KeyFile(keys=[KeyEntry(name=name, sha256=key_hash(key), scopes=SCOPES[name])
                                       for name, key in KEYS.items()]))
    return path


@pytest.fixture(scope="module")
def scoped(nats_proc, trainer, queue_service, keys_file, tmp_path_factory):
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("scoped"),
                       LOOPLINE_API_KEYS_FILE=str(keys_file), LOOPLINE_API_KEYS=PLAIN_KEY)
    yield gw
    launcher.stop(gw.proc)


def client(gw, name: str) -> httpx.Client:
    key = KEYS.get(name, name)
    return httpx.Client(base_url=gw.url, timeout=30,
                        headers={"Authorization": f"Bearer {key}", "X-API-Key": key})


def assert_not_served(resp: httpx.Response, model: str) -> None:
    """Let through the key check to the route, which answers that ``model`` is not served (a 404
    naming it; no replica runs here): anything else, a 500 included, fails."""
    assert resp.status_code == 404, resp.text
    body = resp.json()
    message = body["error"]["message"] if "error" in body else body["detail"]
    assert f"The model `{model}` does not exist" in message, message


def assert_cleared(resp: httpx.Response) -> None:
    """Let through to the queue service, which cleared the (empty) queue."""
    assert resp.status_code == 200 and resp.json() == {"cleared": 0}, resp.text


def test_the_file_holds_hashes_not_keys(keys_file):
    text = keys_file.read_text()
    for name, key in KEYS.items():
        assert key not in text and key_hash(key) in text, name
    assert keys_file.stat().st_mode & 0o077 == 0  # its owner's alone


def test_openai_routes_want_inference(scoped):
    allowed = openai.OpenAI(base_url=f"{scoped.url}/v1", api_key=KEYS["infer"], max_retries=0)
    assert allowed.models.list().data == []  # no replica here: past the gate, an empty list
    refused = openai.OpenAI(base_url=f"{scoped.url}/v1", api_key=KEYS["train"], max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as caught:
        refused.completions.create(model="m", prompt="x")
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "permission_error"
    assert "'inference'" in error["message"] and "train" in error["message"]


def test_vllms_routes_outside_v1_are_keyed_too(scoped):
    for path in ("/tokenize", "/pooling", "/v2/rerank"):
        assert httpx.post(f"{scoped.url}{path}", json={}).status_code == 401, path
    with client(scoped, "infer") as infer, client(scoped, "train") as train:
        # Let through: vLLM's route looks the model up (none is served here).
        assert_not_served(infer.post("/tokenize", json={"model": "m", "prompt": "x"}), "m")
        assert train.post("/tokenize", json={"model": "m", "prompt": "x"}).status_code == 403
    assert httpx.get(f"{scoped.url}/openapi.json").status_code == 200  # the document stays open


def test_scalarlm_routes_want_their_scope(scoped):
    with client(scoped, "train") as train, client(scoped, "infer") as infer, client(scoped, "boss") as boss:
        refused = train.post("/v1/generate", json={"prompts": ["x"]})
        assert refused.status_code == 403 and "'inference'" in refused.json()["detail"]
        assert_not_served(infer.post("/v1/generate", json={"prompts": ["x"]}), BASE_MODEL)
        assert infer.get("/v1/megatron/list_models").status_code == 403
        assert train.get("/v1/megatron/list_models").status_code == 200
        # Operational: admin only, whatever else a key holds.
        for http in (infer, train):
            refused = http.post("/v1/generate/clear_queue")
            assert refused.status_code == 403 and "'admin'" in refused.json()["detail"]
        assert_cleared(boss.post("/v1/generate/clear_queue"))
        assert boss.get("/v1/megatron/list_models").status_code == 200  # admin holds every scope
        # A path with parameters is matched to its route's template.
        assert infer.get("/v1/megatron/train/abc123/events").status_code == 403


def test_tinker_routes_want_their_scope(scoped):
    with client(scoped, "infer") as infer, client(scoped, "train") as train:
        # Session housekeeping: any key.
        assert infer.get("/api/v1/get_server_capabilities").status_code == 200
        refused = infer.post("/api/v1/create_model", json={"session_id": "s", "base_model": "m"})
        assert refused.status_code == 403 and "'training'" in refused.json()["detail"]
        assert train.post("/api/v1/asample", json={}).status_code == 403
        assert train.get("/api/v1/training_runs").status_code == 200
    assert httpx.get(f"{scoped.url}/api/v1/training_runs").status_code == 401  # no key at all


def test_plain_keys_still_hold_every_scope(scoped):
    with client(scoped, PLAIN_KEY) as plain:
        assert plain.get("/v1/models").status_code == 200
        assert plain.get("/v1/megatron/list_models").status_code == 200
        assert_cleared(plain.post("/v1/generate/clear_queue"))


def submit(http: httpx.Client, tag: str) -> str:
    data = archive({DATASET_FILE: jsonlines([*EXAMPLES, {"input": tag, "output": "owner"}])})
    resp = http.post("/v1/megatron/train", files={"file": ("dataset", data, "application/octet-stream")},
                     data={"params": json.dumps({"max_steps": 3, **LOADING})})
    assert resp.status_code == 200, resp.text
    return resp.json()["job_status"]["model_name"]


def test_a_training_key_cancels_only_its_own_jobs(scoped):
    with client(scoped, "train") as mine, client(scoped, "train2") as other, client(scoped, "boss") as boss:
        job = submit(mine, "first")
        # Another key's job is not there for it (tests/gateway/test_tenancy.py): 404, as unknown.
        refused = other.post(f"/v1/megatron/cancel/{job}")
        assert refused.status_code == 404 and "no training job" in refused.json()["detail"]
        assert other.post(f"/v1/megatron/restart/{job}").status_code == 404
        assert mine.post(f"/v1/megatron/cancel/{job}").status_code == 200
        wait_job(mine, job, "CANCELLED")
        # Deleting is admin's alone, even one's own job.
        assert mine.post(f"/v1/megatron/delete/{job}").status_code == 403
        assert boss.post(f"/v1/megatron/delete/{job}").status_code == 200

        theirs = submit(other, "second")
        assert boss.post(f"/v1/megatron/cancel/{theirs}").status_code == 200
        wait_job(other, theirs, "CANCELLED")
