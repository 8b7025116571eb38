"""The training routes against a real gateway process, nats-server and trainer (running the stand-in
training program, whose params set its pace).

The unmodified ``scalarlm`` client drives what it can (train, get_training_job, list_models, cancel,
delete, the CLI's log reader); httpx covers the rest and the error cases. What the trainer got is
read from the job directory it made and the ``datasets`` object store."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import scalarlm
from masint.cli import view_logs

from loopline.common.contracts import subjects
from loopline.common.contracts.job_hash import job_hash as hash_job
from loopline.common.contracts.job_layout import CODE_DIR, DATASET_FILE, EVENTS_FILE, STATUS_FILE
from loopline.common.contracts.job_schemas import ClusterInfo, JobInfo, JobRef
from loopline.common.contracts.train_params import JobConfig, canonical
from loopline.trainer.jobdir import control_dir, log_name, log_path
from support.gateway_process import BASE_MODEL, MAX_MEMBERS, MAX_UPLOAD_BYTES, wait_job
from support.training_data import EXAMPLES, archive, jsonlines, sha256

# The stand-in "loads its model" this long before it writes anything: the job stays QUEUED.
LOADING = {"standin_start_s": 120}


@pytest.fixture
def llm(gateway, tmp_path, monkeypatch):
    # The client ships ./ml when the working directory has one (this repository does): not here.
    monkeypatch.chdir(tmp_path)
    return scalarlm.SupermassiveIntelligence(api_url=gateway.url)


def post_train(http, data: bytes, params=None):
    files = {"file": ("dataset", data, "application/octet-stream")}
    form = {"params": json.dumps(params if params is not None else {"max_steps": 3})}
    return http.post("/v1/megatron/train", files=files, data=form)


def job_log(job_dir: Path, job_status: dict) -> list[str]:
    """The lines of the job's one run's log, as the local launcher captured them."""
    return log_path(job_dir, "local", job_status["job_id"]).read_text().splitlines()


def test_train_and_get_with_the_scalarlm_client(llm, trainer):
    examples = [*EXAMPLES, {"input": "client", "output": "train"}]
    reply = llm.train(examples, train_args={"max_steps": 7, "learning_rate": 1e-3, **LOADING})
    job_hash = reply["job_status"]["model_name"]
    params = {"max_steps": 7, "learning_rate": 1e-3, **LOADING, "llm_name": BASE_MODEL}
    # Our hash: canonical params (llm_name filled in) + the uncompressed dataset, not the gzip bytes.
    assert job_hash == hash_job(params, sha256(jsonlines(examples)))
    assert reply["job_status"]["status"] == "QUEUED" and reply["deployed"] is False
    job_dir = trainer.job_dir(job_hash)
    assert reply["job_status"]["job_directory"] == str(job_dir)
    assert reply["job_config"]["llm_name"] == BASE_MODEL
    assert reply["job_config"]["dataset_hash"] == sha256(jsonlines(examples))
    # What the trainer made of the submit: the uncompressed dataset, the params as hashed, no code.
    assert (job_dir / DATASET_FILE).read_bytes() == jsonlines(examples)
    assert canonical(JobConfig.read(job_dir).params) == params
    assert not (job_dir / CODE_DIR).exists()

    for name in (job_hash, job_hash[:12], "latest"):
        fetched = llm.get_training_job(name)
        assert fetched["job_status"]["model_name"] == job_hash and fetched["job_config"]["max_steps"] == 7
    listed = llm.list_models()["models"]
    assert listed[0]["name"] == job_hash and listed[0]["status"] == "QUEUED"
    # ScalarLM's fields, and ours: why a replica refused the job's newest checkpoint (None here).
    assert set(listed[0]) == {"name", "deployed", "status", "start_time", "step", "max_steps",
                              "train_time", "loss", "deployment_error"}
    assert listed[0]["deployment_error"] is None


def test_same_data_twice_is_one_job_and_one_stored_dataset(llm, http, trainer, nats_bus):
    examples = [*EXAMPLES, {"input": "twice", "output": "once"}]
    # The client's tar.gz differs on every call (gzip header: temp file name, mtime); the job does not.
    first = llm.train(examples, train_args={"max_steps": 2})
    second = llm.train(examples, train_args={"max_steps": 2})
    job_hash = first["job_status"]["model_name"]
    assert second["job_status"]["model_name"] == job_hash
    # One job, queued once and run once (one run's log in its control directory).
    assert [m["name"] for m in llm.list_models()["models"]].count(job_hash) == 1
    wait_job(http, job_hash, "COMPLETED")
    job_dir = trainer.job_dir(job_hash)
    kinds = [json.loads(line)["kind"] for line in (job_dir / EVENTS_FILE).read_text().splitlines()]
    assert kinds.count("queued") == 1 and kinds[-1] == "completed"
    assert len(list(control_dir(job_dir).glob(log_name("local", "*")))) == 1
    # New params, same data: a new job that reuses the stored dataset object instead of writing it.
    dataset = sha256(jsonlines(examples))
    before = nats_bus.dataset_info(dataset)
    other = llm.train(examples, train_args={"max_steps": 3})
    other_hash = other["job_status"]["model_name"]
    assert other_hash != job_hash and other["job_config"]["dataset_hash"] == dataset
    assert (trainer.job_dir(other_hash) / DATASET_FILE).read_bytes() == jsonlines(examples)
    assert nats_bus.dataset_info(dataset).nuid == before.nuid


def test_ml_code_travels_as_its_own_object(llm, trainer, nats_bus, tmp_path):
    (tmp_path / "ml" / "cray_megatron").mkdir(parents=True)
    (tmp_path / "ml" / "cray_megatron" / "main.py").write_text("print('my loop')\n")
    reply = llm.train(EXAMPLES, train_args={"max_steps": 4})
    job_hash = reply["job_status"]["model_name"]
    # The answer says the job runs the code it shipped (keys ScalarLM's client does not read).
    config = reply["job_config"]
    assert config["ml_code"] == "shipped" and "runs the ml/ code" in config["ml_code_note"]
    info = nats_bus.ask_trainer(subjects.SVC_TRAINER_GET, JobRef(job=job_hash), JobInfo)
    code = nats_bus.dataset(info.code_sha256)
    assert sha256(code) == info.code_sha256 and b"print('my loop')" in code
    # The code is part of the job: in its hash, and unpacked into its ml/ (first on its PYTHONPATH).
    params = {"max_steps": 4, "llm_name": BASE_MODEL}
    assert job_hash == hash_job(params, sha256(jsonlines(EXAMPLES)), info.code_sha256)
    main = trainer.job_dir(job_hash) / CODE_DIR / "cray_megatron" / "main.py"
    assert main.read_text() == "print('my loop')\n"


def test_the_client_run_in_a_loopline_checkout_ships_loopline_own_ml(gateway, trainer, monkeypatch):
    # This repository's ml/ holds the installed loopline.ml (an editable install): not user code.
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    llm = scalarlm.SupermassiveIntelligence(api_url=gateway.url)
    reply = llm.train(EXAMPLES, train_args={"max_steps": 2, "seed": 7})
    assert reply["job_config"]["ml_code"] == "installed"
    assert not (trainer.job_dir(reply["job_status"]["model_name"]) / CODE_DIR).exists()


def test_unknown_job_is_404_everywhere(http):
    missing = "f" * 64
    for method, path in [("GET", f"/v1/megatron/train/{missing}"),
                         ("POST", f"/v1/megatron/cancel/{missing}"),
                         ("POST", f"/v1/megatron/delete/{missing}"),
                         ("POST", f"/v1/megatron/restart/{missing}"),
                         ("GET", f"/v1/megatron/train/logs/{missing}"),
                         ("GET", f"/v1/megatron/train/{missing}/events")]:
        resp = http.request(method, path)
        assert resp.status_code == 404, (path, resp.text)
        assert missing in resp.json()["detail"]


def test_oversized_upload_is_413(http):
    big = bytes(range(256)) * (MAX_UPLOAD_BYTES // 256 + 1)
    resp = post_train(http, big)
    assert resp.status_code == 413 and "limit" in resp.json()["detail"]
    init = {"total_size": MAX_UPLOAD_BYTES + 1, "total_hash": "0" * 64, "chunk_size": 1024,
            "num_chunks": MAX_UPLOAD_BYTES // 1024 + 1, "params": {}}
    assert http.post("/v1/megatron/upload/init", json=init).status_code == 413


def test_tar_bombs_are_413(http):
    # 8 MiB of zeros pack into a few KiB; the gateway stops inflating at its (test) 1 MiB limit.
    bomb = archive({DATASET_FILE: jsonlines(EXAMPLES), "ml/zeros": bytes(8 * 1024 * 1024)})
    assert len(bomb) < MAX_UPLOAD_BYTES
    resp = post_train(http, bomb)
    assert resp.status_code == 413 and "more than" in resp.json()["detail"]
    empty_files = {f"ml/{i}.py": b"" for i in range(MAX_MEMBERS)}
    many = archive({DATASET_FILE: jsonlines(EXAMPLES), **empty_files})
    resp = post_train(http, many)
    assert resp.status_code == 413 and "entries" in resp.json()["detail"]


@pytest.mark.parametrize("data, status, message", [
    (archive({DATASET_FILE: jsonlines(EXAMPLES) + b'{"input": "x"}\n'}), 422,
     "line 3: 'output' is missing"),
    (archive({DATASET_FILE: b"not json\n"}), 422, "line 1: not valid JSON"),
    (archive({"data.jsonl": jsonlines(EXAMPLES)}), 422, "no dataset.jsonlines"),
    (archive({DATASET_FILE: jsonlines(EXAMPLES), "../escape.py": b"x"}), 400, "outside"),
    (archive({DATASET_FILE: jsonlines(EXAMPLES)})[:-20], 400, "not a readable"),
])
def test_bad_archives_get_a_clear_4xx(http, data, status, message):
    resp = post_train(http, data)
    assert resp.status_code == status, resp.text
    assert message in resp.json()["detail"]


def test_bad_multipart_bodies(http):
    resp = http.post("/v1/megatron/train", data={"params": "{}"}, files={"other": ("x", b"x")})
    assert resp.status_code == 400 and "'file'" in resp.json()["detail"]
    resp = http.post("/v1/megatron/train", files={"file": ("dataset", jsonlines(EXAMPLES))},
                     data={"params": "{not json"})
    assert resp.status_code == 400 and "params" in resp.json()["detail"]
    resp = http.post("/v1/megatron/train", files={"file": ("dataset", jsonlines(EXAMPLES))},
                     data={"params": "[1, 2]"})
    assert resp.status_code == 422


def test_plain_jsonlines_and_llm_name_given(http, trainer):
    params = {"max_steps": 5, "llm_name": "other/model"}
    resp = post_train(http, jsonlines(EXAMPLES), params)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["job_config"]["llm_name"] == "other/model"
    job_hash = body["job_status"]["model_name"]
    assert job_hash == hash_job(params, sha256(jsonlines(EXAMPLES)))
    assert JobConfig.read(trainer.job_dir(job_hash)).params.llm_name == "other/model"


@pytest.mark.parametrize("params, field", [
    ({"max_steps": 0}, "params.max_steps"),
    ({"learning_rate": "fast"}, "params.learning_rate"),
    ({"lora_config": {"r": 8.5}}, "params.lora_config.r"),
    ({"adapter_type": "dora"}, "params.adapter_type"),
    ({"tensor_parallel": 2, "adapter_type": "lora"}, "params"),
    ({"push_to_hub": {"repo_id": "not a repo"}}, "params.push_to_hub.repo_id"),
    ({"push_to_hub": {"repo_id": "no-namespace"}}, "params.push_to_hub.repo_id"),
    ({"push_to_hub": {"repo_id": "me/model", "revision": "refs/pr/1"}}, "params.push_to_hub.revision"),
    ({"push_to_hub": {"repo_id": "me/model", "token": "hf_x"}}, "params.push_to_hub.token"),
])
def test_bad_params_are_a_422_naming_the_field_before_anything_is_stored(http, nats_bus, params, field):
    from nats.js.errors import NotFoundError

    examples = [*EXAMPLES, {"input": "refused", "output": field}]
    resp = post_train(http, archive({DATASET_FILE: jsonlines(examples)}), params)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"].startswith(f"{field}: "), resp.json()["detail"]
    with pytest.raises(NotFoundError):
        nats_bus.dataset_info(sha256(jsonlines(examples)))


def test_params_that_mean_the_same_are_one_job(http, trainer):
    data = jsonlines([*EXAMPLES, {"input": "canonical", "output": "params"}])
    first = post_train(http, data, {"max_steps": 4, "seed": None, "adapter_type": "LoRA", "gpus": 2}).json()
    second = post_train(http, data, {"adapter_type": "lora", "gpus": 2, "max_steps": 4}).json()
    job_hash = first["job_status"]["model_name"]
    assert second["job_status"]["model_name"] == job_hash
    params = {"max_steps": 4, "adapter_type": "lora", "gpus": 2, "llm_name": BASE_MODEL}
    assert job_hash == hash_job(params, sha256(data))
    # What the client sent beyond our params is kept (it is part of the job) and shown back.
    assert first["job_config"]["gpus"] == 2 and first["job_config"]["adapter_type"] == "lora"
    assert canonical(JobConfig.read(trainer.job_dir(job_hash)).params) == params


def test_cancel_restart_delete_pass_the_trainer_through(llm, http, trainer):
    job_hash = llm.train(EXAMPLES, train_args={"max_steps": 9, **LOADING})["job_status"]["model_name"]
    resp = http.post(f"/v1/megatron/restart/{job_hash}")
    assert resp.status_code == 409 and "QUEUED" in resp.json()["detail"]
    assert llm.cancel(job_hash)["job_status"]["status"] == "CANCELLED"
    restarted = http.post(f"/v1/megatron/restart/{job_hash}").json()["job_status"]
    assert restarted["model_name"] == job_hash and restarted["status"] == "QUEUED"
    assert llm.delete(job_hash)["job_status"]["model_name"] == job_hash
    assert http.get(f"/v1/megatron/train/{job_hash}").status_code == 404
    assert not trainer.job_dir(job_hash).exists()


def test_cluster_routes(llm, http, nats_bus):
    cluster = nats_bus.ask_trainer(subjects.SVC_TRAINER_CLUSTER, None, ClusterInfo)
    assert cluster.launcher == "local" and cluster.node_count == 1
    assert llm.get_gpu_count() == cluster.gpu_count and llm.get_node_count() == 1
    assert "JOBID" in http.get("/v1/megatron/squeue").json()["squeue_output"]


def test_logs_as_the_scalarlm_cli_reads_them(llm, http, gateway, trainer, monkeypatch):
    job_hash = llm.train(EXAMPLES, train_args={"max_steps": 5})["job_status"]["model_name"]
    done = wait_job(http, job_hash, "COMPLETED")
    written = job_log(trainer.job_dir(job_hash), done)
    assert [line for line in written if line.startswith("standin: step")] == \
        [f"standin: step {i} of 5" for i in range(1, 6)]
    monkeypatch.setenv("SCALARLM_API_URL", gateway.url)
    lines = asyncio.run(view_logs.sample_log_stream(model_name=job_hash, starting_line_number=2))
    assert [(x["line_number"], x["line"]) for x in lines] == list(enumerate(written))[2:]


def test_logs_follow_a_running_job_until_it_ends(llm, http, trainer):
    # About 2 s of steps: the stream opens while it runs and must end by itself when it is over.
    params = {"max_steps": 8, "standin_step_s": 0.25}
    job_hash = llm.train(EXAMPLES, train_args=params)["job_status"]["model_name"]
    with http.stream("GET", f"/v1/megatron/train/logs/{job_hash}") as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.iter_lines()
        first = json.loads(next(lines))
        assert first["line_number"] == 0
        assert wait_job(http, job_hash, "QUEUED", "TRAINING", timeout_s=0)["step"] < 8  # still running
        rest = [json.loads(line) for line in lines if line]
    done = wait_job(http, job_hash, "COMPLETED", timeout_s=0)
    written = job_log(trainer.job_dir(job_hash), done)
    assert [first, *rest] == [{"line": text, "line_number": n} for n, text in enumerate(written)]
    assert written[-1] == "standin: completed"
    snapshot = http.get(f"/v1/megatron/train/logs/{job_hash}", params={"follow": "false"})
    assert [json.loads(x)["line"] for x in snapshot.text.splitlines()] == written


def test_a_jobs_history_and_log_come_in_pages(llm, http, trainer):
    job_hash = llm.train(EXAMPLES, train_args={"max_steps": 2})["job_status"]["model_name"]
    done = wait_job(http, job_hash, "COMPLETED")
    job_dir = trainer.job_dir(job_hash)
    points = [{"step": i, "loss": 1.0} for i in range(3000)]
    (job_dir / STATUS_FILE).write_text(json.dumps({"status": "COMPLETED", "history": points}))
    newest = http.get(f"/v1/megatron/train/{job_hash}").json()["job_status"]
    assert (newest["history_total"], newest["history_offset"], len(newest["history"])) == (3000, 1976, 1024)
    page = http.get(f"/v1/megatron/train/{job_hash}", params={"history_offset": 5, "history_limit": 3})
    assert [p["step"] for p in page.json()["job_status"]["history"]] == [5, 6, 7]
    refused = http.get(f"/v1/megatron/train/{job_hash}", params={"history_limit": 5000})
    assert refused.status_code == 422 and "LOOPLINE_MAX_HISTORY_POINTS" in refused.text
    # 40 lines of 60 KB: more than one reply of the trainer's (LOOPLINE_MAX_LOG_PAGE_BYTES); the
    # stream asks again for the rest rather than ending at a short page.
    with log_path(job_dir, "local", done["job_id"]).open("a") as log:
        log.writelines(f"{i} {'z' * 60_000}\n" for i in range(40))
    snapshot = http.get(f"/v1/megatron/train/logs/{job_hash}", params={"follow": "false"})
    lines = [json.loads(x) for x in snapshot.text.splitlines()]
    assert [x["line"].split(" ")[0] for x in lines[-40:]] == [str(i) for i in range(40)]
    assert [x["line_number"] for x in lines] == list(range(len(lines)))


def test_no_trainer_is_503(http, trainer):
    trainer.stop()
    try:
        resp = http.get("/v1/megatron/list_models")
        assert resp.status_code == 503 and "trainer is not running" in resp.json()["detail"]
        assert resp.headers["retry-after"] == "5"
        assert post_train(http, jsonlines(EXAMPLES), {"max_steps": 99}).status_code == 503
    finally:
        trainer.start()
    assert http.get("/v1/megatron/list_models").status_code == 200
