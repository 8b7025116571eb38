"""Tenants kept apart (auth/tenancy.py), on a real gateway process and the real trainer with a keys
file: two training keys (``a``, ``b``), an inference key and an admin key. A key without ``admin``
sees only its own jobs, and another key's job is answered exactly as an unknown one (the same 404,
never its status); ``latest`` is the caller's own latest; admin sees every job. Without keys
(the module's plain ``gateway``) everything is one user's, as before keys."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

import httpx
import pytest

from loopline.common.contracts import subjects, tinker_names
from loopline.common.contracts.job_layout import DATASET_FILE
from loopline.common.contracts.job_schemas import AdapterEvent
from loopline.common.contracts.schemas import DeploymentInfo, WorkItem
from loopline.common.contracts.tinker_schemas import FutureResult, TinkerSampler
from loopline.common.local import launcher
from loopline.common.runtime.tinker_store import TinkerStore
from loopline.gateway.auth.key_store import KeyEntry, KeyFile, key_hash, new_key, write_key_file
from support import tinker_records as records
from support.bus_view import BusView
from support.census_replica import census_replica
from support.gateway_process import BASE_MODEL, start_gateway
from support.tinker_records import TinkerBus
from support.training_data import EXAMPLES, archive, jsonlines

# Four keys against a real gateway and trainer, every route family: ~25 s, so out of the edit loop.
pytestmark = pytest.mark.slow

KEYS = {name: new_key() for name in ("a", "b", "infer", "boss")}
# Two tenants that train and use their adapters, a key that only generates, and an admin.
SCOPES = {"a": ["training", "inference"], "b": ["training", "inference"], "infer": ["inference"],
          "boss": ["admin"]}
# The stand-in "loads its model" this long before it writes anything: the job stays QUEUED.
LOADING = {"standin_start_s": 120}
UNKNOWN = "e" * 64


@pytest.fixture(scope="module")
def keyed(nats_proc, trainer, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api_keys.json"
    write_key_file(path, KeyFile(keys=[KeyEntry(name=name, sha256=key_hash(key), scopes=SCOPES[name])
                                       for name, key in KEYS.items()]))
    # A ScalarLM /v1/generate answers with its request ids after 1 s: no replica answers here; a
    # Tinker future not (yet) there is "try again" after 1 s.
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("tenants"),
                       LOOPLINE_API_KEYS_FILE=str(path), LOOPLINE_RESPONSE_TIMEOUT_S="1",
                       LOOPLINE_TINKER_POLL_S="1")
    yield gw
    launcher.stop(gw.proc)


@pytest.fixture
def a(keyed):
    with client(keyed, "a") as http:
        yield http


@pytest.fixture
def b(keyed):
    with client(keyed, "b") as http:
        yield http


@pytest.fixture
def boss(keyed):
    with client(keyed, "boss") as http:
        yield http


def client(gw, name: str) -> httpx.Client:
    return httpx.Client(base_url=gw.url, timeout=30,
                        headers={"Authorization": f"Bearer {KEYS[name]}", "X-API-Key": KEYS[name]})


def submit(http: httpx.Client, tag: str) -> str:
    data = archive({DATASET_FILE: jsonlines([*EXAMPLES, {"input": tag, "output": "tenant"}])})
    resp = http.post("/v1/megatron/train", files={"file": ("dataset", data, "application/octet-stream")},
                     data={"params": json.dumps({"max_steps": 3, **LOADING})})
    assert resp.status_code == 200, resp.text
    return resp.json()["job_status"]["model_name"]


def as_unknown(resp: httpx.Response, named: str) -> tuple[int, str]:
    """The answer with the name it was asked by replaced: comparable with the unknown job's."""
    return resp.status_code, resp.text.replace(named, UNKNOWN)


def unknown(http: httpx.Client, method: str, path: str) -> tuple[int, str]:
    return as_unknown(http.request(method, path.format(job=UNKNOWN)), UNKNOWN)


def listed(http: httpx.Client) -> set[str]:
    resp = http.get("/v1/megatron/list_models")
    assert resp.status_code == 200, resp.text
    return {model["name"] for model in resp.json()["models"]}


# Every route that names a job: another key's job is the unknown job's answer, byte for byte.
JOB_ROUTES = [("GET", "/v1/megatron/train/{job}"), ("GET", "/v1/megatron/train/logs/{job}?follow=false"),
              ("GET", "/v1/megatron/train/{job}/events"), ("POST", "/v1/megatron/cancel/{job}"),
              ("POST", "/v1/megatron/restart/{job}")]


def test_another_keys_job_is_an_unknown_job(a, b, boss):
    job = submit(a, "a-private")
    for method, path in JOB_ROUTES:
        for name in (job, job[:12]):  # by hash and by prefix
            theirs = as_unknown(b.request(method, path.format(job=name)), name)
            assert theirs[0] == 404, (path, theirs)
            assert theirs == unknown(b, method, path), path  # same status, same body: no status, no step
        assert "QUEUED" not in b.request(method, path.format(job=job)).text
    # The owner and admin read it; its owner's other keys' listing does not show it.
    assert a.get(f"/v1/megatron/train/{job}").json()["job_status"]["status"] == "QUEUED"
    assert boss.get(f"/v1/megatron/train/{job}").status_code == 200
    assert job in listed(a) and job in listed(boss) and job not in listed(b)
    assert b.get(f"/v1/megatron/train/logs/{job[:12]}?follow=false").status_code == 404


def test_the_queue_shows_a_key_its_own_jobs_only(a, b, boss):
    job = submit(a, "a-queued")
    shown = {name: http.get("/v1/megatron/squeue").json()["squeue_output"] for name, http in
             (("a", a), ("b", b), ("boss", boss))}
    # The local launcher's rows name a job by the first 16 digits of its hash.
    assert job[:16] in shown["a"] and job[:16] in shown["boss"], shown
    assert job[:16] not in shown["b"] and shown["b"].startswith("JOBID"), shown


def test_latest_is_the_callers_own(a, b, boss):
    mine = submit(b, "b-first")
    theirs = submit(a, "a-later")  # newer than b's: 'latest' of every job
    assert b.get("/v1/megatron/train/latest").json()["job_status"]["model_name"] == mine
    assert a.get("/v1/megatron/train/latest").json()["job_status"]["model_name"] == theirs
    assert boss.get("/v1/megatron/train/latest").json()["job_status"]["model_name"] == theirs
    # b cancels its 'latest': its own job, never a's newer one.
    assert b.post("/v1/megatron/cancel/latest").json()["job_status"]["model_name"] == mine
    assert a.get(f"/v1/megatron/train/{theirs}").json()["job_status"]["status"] == "QUEUED"
    assert boss.post(f"/v1/megatron/cancel/{theirs}").status_code == 200  # admin controls any job


def test_the_same_content_is_a_job_per_key(a, b):
    first, second = submit(a, "same"), submit(b, "same")
    assert first != second
    assert a.get(f"/v1/megatron/train/{first}").json()["job_status"]["model_name"] == first
    assert b.get(f"/v1/megatron/train/{first}").status_code == 404


def test_the_all_jobs_stream_holds_the_keys_own_jobs(keyed, a, b):
    theirs = submit(a, "a-streamed")
    mine = submit(b, "b-streamed")  # after a's: its events come later in the stream
    seen: list[str] = []
    with client(keyed, "b") as http, http.stream("GET", "/v1/megatron/events") as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line[len("data: "):])["job_hash"])
                if mine in seen:
                    break
    assert theirs not in seen and mine in seen and set(seen) <= listed(b)


def test_without_keys_every_job_is_everyones(gateway, tmp_path):
    with httpx.Client(base_url=gateway.url, timeout=30) as one, httpx.Client(base_url=gateway.url) as two:
        job = submit(one, "keyless")
        assert two.get(f"/v1/megatron/train/{job}").json()["job_status"]["model_name"] == job
        assert two.get("/v1/megatron/train/latest").json()["job_status"]["model_name"] == job
        assert job in listed(two)
        assert submit(two, "keyless") == job  # same content, one job, as before keys
        assert two.post(f"/v1/megatron/cancel/{job[:12]}").status_code == 200


# --- adapters: /v1/models, a request's `model`, `latest` ------------------------------------------

@pytest.fixture(scope="module")
def base_served(nats_proc):
    """The gateway's base model served, as far as the gateway can tell (support/census_replica.py)."""
    info = DeploymentInfo(model=BASE_MODEL, deployment="base", max_model_len=256, engine="vllm")
    with census_replica(nats_proc.info["url"], info):
        yield BASE_MODEL


def load_adapter(nats_url: str, job: str) -> None:
    """What a replica announces once it has loaded a checkpoint of ``job``."""
    event = AdapterEvent(job_hash=job, kind="loaded", step=1, replica="test-replica", base_model=BASE_MODEL)

    async def publish(nc) -> None:
        await nc.jetstream().publish(subjects.adapter_event(job, "loaded"), event.model_dump_json().encode())

    BusView(nats_url).ask(publish)


def model_ids(http: httpx.Client) -> list[str]:
    resp = http.get("/v1/models")
    assert resp.status_code == 200, resp.text
    return [model["id"] for model in resp.json()["data"]]


def completion(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1}, timeout=10)


def test_models_and_adapters_are_the_keys_own(keyed, nats_proc, base_served, a, b, boss):
    job_a, job_b = submit(a, "a-adapter"), submit(b, "b-adapter")
    load_adapter(nats_proc.info["url"], job_b)
    load_adapter(nats_proc.info["url"], job_a)  # loaded last: 'latest' of every tenant
    with client(keyed, "infer") as infer:
        deadline = time.monotonic() + 10
        while job_a not in model_ids(boss) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert model_ids(boss)[0] == base_served and {job_a, job_b} <= set(model_ids(boss))
        # An inference key owns no job: the base models only.
        assert model_ids(infer) == [base_served]
        unknown_model = as_unknown(completion(infer, UNKNOWN), UNKNOWN)
        assert unknown_model[0] == 404
        for http, mine, theirs in ((a, job_a, job_b), (b, job_b, job_a)):
            ids = model_ids(http)
            assert mine in ids and theirs not in ids and base_served in ids
            assert as_unknown(completion(http, theirs), theirs) == unknown_model
            assert as_unknown(generate(http, theirs), theirs) == as_unknown(generate(http, UNKNOWN), UNKNOWN)
            assert routed_to(http, mine, nats_proc.info["url"]) == mine
        # 'latest' is the caller's own: b's, though a's adapter was loaded after it.
        assert routed_to(b, "latest", nats_proc.info["url"]) == job_b
        assert routed_to(a, "latest", nats_proc.info["url"]) == job_a
        assert routed_to(boss, "latest", nats_proc.info["url"]) == job_a
        latest = generate(infer, "latest")
        assert latest.status_code == 404 and "no training job has a deployed adapter" in latest.text


def generate(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/generate", json={"prompts": [f"tenancy {time.monotonic()}"], "model": model,
                                           "max_tokens": 1})


def routed_to(http: httpx.Client, model: str, nats_url: str) -> str | None:
    """The adapter a ScalarLM request naming ``model`` was queued with: read from the WORK stream."""
    resp = generate(http, model)
    assert resp.status_code == 200, resp.text

    async def last_item(nc) -> WorkItem:
        msg = await nc.jetstream().get_last_msg(subjects.WORK_STREAM, subjects.work("base"))
        return WorkItem.model_validate_json(msg.data)

    return BusView(nats_url).ask(last_item).adapter


# --- Tinker: sessions, training runs, checkpoints, sampling sessions, futures ---------------------

@pytest.fixture(scope="module")
def runs(keyed, nats_proc):
    """A Tinker session, training run, checkpoints and sampling session of each training key, as
    the gateway, the trainer and a session worker would have written them; and a stored training
    future of a's run."""
    tinker = TinkerBus(nats_proc.info["url"])
    on = records.worker()
    made = {}
    for owner in ("a", "b"):
        session = records.session(owner=owner)
        run = records.model(session, on, owner=owner)
        sampler = TinkerSampler(sampling_session_id=tinker_names.new_id(), base_model=records.BASE,
                                owner=owner)
        tinker.put(session, on, run, records.checkpoint(run, "weights", "w1"),
                   records.checkpoint(run, "sampler_weights", "s1", adapter="f" * 64))
        made[owner] = Tinker(session.session_id, run.model_id, sampler.sampling_session_id,
                             tinker_names.request_id(run.model_id, 0, "optim_step"))

        async def put_sampler(nc, sampler=sampler) -> None:
            store = TinkerStore(nc.jetstream(), nc.max_payload)
            await store.start()
            await store.put_sampler(sampler)

        tinker.ask(put_sampler)

    async def finish(nc) -> None:
        store = TinkerStore(nc.jetstream(), nc.max_payload)
        await store.start()
        await store.finish(FutureResult(request_id=made["a"].future, model_id=made["a"].run, ok=False,
                                        category="user", error="x"))

    tinker.ask(finish)
    return made


@dataclass
class Tinker:
    session: str
    run: str
    sampler: str
    future: str  # a training call's of the run


def tinker_routes(t: Tinker) -> list[tuple[str, str, dict | None]]:
    """Every Tinker route that names one of ``t``'s things, and what it sends."""
    weights = f"tinker://{t.run}/weights/w1"
    return [("GET", f"/api/v1/training_runs/{t.run}", None),
            ("GET", f"/api/v1/training_runs/{t.run}/checkpoints", None),
            ("POST", "/api/v1/weights_info", {"tinker_path": weights}),
            ("GET", f"/api/v1/sessions/{t.session}", None),
            ("GET", f"/api/v1/samplers/{t.sampler}", None),
            ("POST", "/api/v1/get_info", {"model_id": t.run}),
            ("POST", "/api/v1/session_heartbeat", {"session_id": t.session}),
            ("POST", "/api/v1/create_sampling_session",
             {"session_id": t.session, "sampling_session_seq_id": 0,
              "model_path": f"tinker://{t.run}/sampler_weights/s1"}),
            ("GET", f"/v1/tinker/runs/{t.run}/events", None),
            ("DELETE", f"/api/v1/training_runs/{t.run}/checkpoints/weights/w1", None)]


def test_tinker_things_are_their_keys_own(keyed, runs, a, b, boss):
    fake = Tinker(tinker_names.new_id(), tinker_names.model_id(tinker_names.new_id(), 0),
                  tinker_names.new_id(), "")
    fake_routes = tinker_routes(fake)
    for method, path, body in tinker_routes(runs["a"])[:-1]:  # the delete last, once b is refused
        theirs = b.request(method, path, json=body)
        unknown_route = fake_routes[tinker_routes(runs["a"]).index((method, path, body))]
        nobody = b.request(unknown_route[0], unknown_route[1], json=unknown_route[2])
        assert theirs.status_code in (404, 410), (path, theirs.text)
        assert theirs.status_code == nobody.status_code, path
        ids = (runs["a"].run, runs["a"].session, runs["a"].sampler)
        fakes = (fake.run, fake.session, fake.sampler)
        text = theirs.text
        for mine, other in zip(ids, fakes, strict=True):
            text = text.replace(mine, other)
        assert text == nobody.text, path
        if method == "GET" and "/events" not in path:
            assert a.request(method, path, json=body).status_code == 200, path
            assert boss.request(method, path, json=body).status_code == 200, path
    method, path, body = tinker_routes(runs["a"])[-1]
    assert b.request(method, path).status_code == 404
    assert a.request("GET", f"/api/v1/training_runs/{runs['a'].run}/checkpoints").json()["checkpoints"]
    # Listings: each key its own, admin every one.
    for http, mine, theirs in ((a, runs["a"], runs["b"]), (b, runs["b"], runs["a"])):
        listed_runs = run_ids(http)
        assert mine.run in listed_runs and theirs.run not in listed_runs
        sessions = http.get("/api/v1/sessions").json()["sessions"]
        assert mine.session in sessions and theirs.session not in sessions
    assert {runs["a"].run, runs["b"].run} <= run_ids(boss)


def run_ids(http: httpx.Client) -> set[str]:
    resp = http.get("/api/v1/training_runs")
    assert resp.status_code == 200, resp.text
    return {run["training_run_id"] for run in resp.json()["training_runs"]}


def test_an_inference_key_reads_no_training_future(keyed, runs, a):
    with client(keyed, "infer") as infer:
        refused = infer.post("/api/v1/retrieve_future", json={"request_id": runs["a"].future})
        assert refused.status_code == 403 and "'training'" in refused.json()["detail"]
    assert a.post("/api/v1/retrieve_future", json={"request_id": runs["a"].future}).json()["error"] == "x"


def test_another_training_keys_future_is_one_nobody_made(runs, a, b, boss):
    """b knows a's future id (it derives from a's run id): b is told to try again, exactly as for an
    id nobody made, and never sees a's result; admin does."""
    unknown = tinker_names.request_id(tinker_names.model_id(tinker_names.new_id(), 0), 0, "optim_step")
    theirs = b.post("/api/v1/retrieve_future", json={"request_id": runs["a"].future})
    nobody = b.post("/api/v1/retrieve_future", json={"request_id": unknown})
    assert theirs.status_code == nobody.status_code == 200, theirs.text
    assert theirs.json() == {**nobody.json(), "request_id": runs["a"].future}
    assert theirs.json()["type"] == "try_again"
    assert boss.post("/api/v1/retrieve_future", json={"request_id": runs["a"].future}).json()["error"] == "x"


def test_get_info_names_a_tokenizer_the_client_can_load(runs, a, nats_proc, tmp_path):
    """The SDK's get_tokenizer() loads get_info's tokenizer_id on the client's machine: by default
    the model's name (a Hub id), not a folder of the gateway's machine; ``folder`` (make up) gives
    the folder, for clients beside it."""
    info = a.post("/api/v1/get_info", json={"model_id": runs["a"].run}).json()
    assert info["model_data"] == {"model_name": records.BASE, "tokenizer_id": records.BASE}
    beside = start_gateway(nats_proc.info["url"], tmp_path, LOOPLINE_TINKER_TOKENIZER_ID="folder")
    try:
        info = httpx.post(f"{beside.url}/api/v1/get_info", json={"model_id": runs["a"].run},
                          timeout=30).json()
    finally:
        launcher.stop(beside.proc)
    assert info["model_data"]["tokenizer_id"] == records.worker().model_path


def test_without_keys_every_tinker_run_is_everyones(gateway, runs):
    with httpx.Client(base_url=gateway.url, timeout=30) as anyone:
        assert {runs["a"].run, runs["b"].run} <= run_ids(anyone)
        assert anyone.get(f"/api/v1/training_runs/{runs['b'].run}").status_code == 200


def test_a_tenant_trains_only_a_served_base_model(a, boss):
    def train(http: httpx.Client, llm_name: str) -> httpx.Response:
        data = archive({DATASET_FILE: jsonlines([*EXAMPLES, {"input": llm_name, "output": "base"}])})
        return http.post("/v1/megatron/train", files={"file": ("dataset", data, "application/octet-stream")},
                         data={"params": json.dumps({"max_steps": 3, "llm_name": llm_name, **LOADING})})

    for elsewhere in ("/etc", "some-org/any-hub-model"):
        refused = train(a, elsewhere)
        assert refused.status_code == 400, refused.text
        detail = refused.json()["detail"]
        assert "params.llm_name" in detail and "LOOPLINE_ALLOW_ANY_BASE_MODEL" in detail
        assert BASE_MODEL in detail  # what it may name instead
    assert train(a, BASE_MODEL).status_code == 200
    assert train(boss, "some-org/any-hub-model").status_code == 200  # admin may


# --- ScalarLM batches: get_results, upload, download -----------------------------------------------

def test_a_batch_is_its_keys_own(keyed, base_served, a, b, boss):
    prompts = {"prompts": ["batch of a"], "model": base_served, "max_tokens": 1}
    ids = [entry["request_id"] for entry in a.post("/v1/generate", json=prompts).json()["results"]]
    unknown_ids = [f"{'e' * 64}_{rid.rpartition('_')[2]}" for rid in ids]

    def poll(http: httpx.Client, request_ids: list[str]) -> httpx.Response:
        return http.post("/v1/generate/get_results", json={"request_ids": request_ids})

    theirs = poll(b, ids)
    assert theirs.status_code == 404
    assert theirs.text.replace(ids[0].rpartition("_")[0], "e" * 64) == poll(b, unknown_ids).text
    assert poll(a, ids).status_code == 200 and poll(boss, ids).status_code == 200
    # The same prompts from b: a batch of its own, not a's (whose answers it would read).
    mine = [entry["request_id"] for entry in b.post("/v1/generate", json=prompts).json()["results"]]
    assert mine != ids

    upload = b'[{"prompt": "upload of a", "max_tokens": 1}]'
    batch = a.post("/v1/generate/upload", files={"file": ("requests.json", upload)}).json()["request_id"]

    def download(http: httpx.Client, batch_id: str) -> httpx.Response:
        return http.post("/v1/generate/download", json={"request_id": batch_id})

    assert as_unknown(download(b, batch), batch) == as_unknown(download(b, "e" * 64), "e" * 64)
    assert download(b, batch).status_code == 404
    assert download(a, batch).status_code == 200
    same_file = b.post("/v1/generate/upload", files={"file": ("requests.json", upload)})
    assert same_file.json()["request_id"] != batch


# --- ScalarLM chunked training uploads ------------------------------------------------------------

def test_a_chunked_upload_is_its_keys_own(a, b):
    data = archive({DATASET_FILE: jsonlines([*EXAMPLES, {"input": "chunked", "output": "a"}])})
    declared = {"total_size": len(data), "total_hash": hashlib.sha256(data).hexdigest(),
                "chunk_size": len(data), "num_chunks": 1, "compressed": True, "params": {"max_steps": 3}}
    upload_id = a.post("/v1/megatron/upload/init", json=declared).json()["upload_id"]
    # b declares the very same archive: an upload of its own, not a's.
    assert b.post("/v1/megatron/upload/init", json=declared).json()["upload_id"] != upload_id

    def chunk(http: httpx.Client, name: str) -> httpx.Response:
        return http.post("/v1/megatron/upload/chunk", content=data, headers={
            "X-Upload-Id": name, "X-Chunk-Index": "0", "X-Chunk-Hash": hashlib.sha256(data).hexdigest(),
            "Content-Type": "application/octet-stream"})

    def finalize(http: httpx.Client, name: str) -> httpx.Response:
        return http.post("/v1/megatron/upload/finalize", json={"upload_id": name})

    unknown_id = "e" * 32
    for call in (chunk, finalize):
        theirs = call(b, upload_id)
        assert theirs.status_code == 404
        assert as_unknown(theirs, upload_id) == as_unknown(call(b, unknown_id), unknown_id)
    assert chunk(a, upload_id).status_code == 200
    finished = finalize(a, upload_id)
    assert finished.status_code == 200, finished.text
    job = finished.json()["job_status"]["model_name"]
    assert a.get(f"/v1/megatron/train/{job}").status_code == 200
    assert b.get(f"/v1/megatron/train/{job}").status_code == 404
