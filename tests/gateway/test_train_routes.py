"""The training routes against a real gateway process and nats-server, the trainer stood in for.

The unmodified ``scalarlm`` client drives what it can (train, get_training_job, list_models, cancel,
delete, the CLI's log reader); httpx covers the rest and the error cases."""

from __future__ import annotations

import asyncio
import json

import pytest
import scalarlm
from masint.cli import view_logs

from loopline.common.job_hash import job_hash as hash_job
from loopline.common.job_layout import DATASET_FILE
from support.gateway_process import BASE_MODEL, MAX_MEMBERS, MAX_UPLOAD_BYTES
from support.training_data import EXAMPLES, archive, jsonlines, sha256


@pytest.fixture
def llm(gateway, tmp_path, monkeypatch):
    # The client ships ./ml when the working directory has one (this repository does): not here.
    monkeypatch.chdir(tmp_path)
    return scalarlm.SupermassiveIntelligence(api_url=gateway.url)


def post_train(http, data: bytes, params=None):
    files = {"file": ("dataset", data, "application/octet-stream")}
    form = {"params": json.dumps(params if params is not None else {"max_steps": 3})}
    return http.post("/v1/megatron/train", files=files, data=form)


def test_train_and_get_with_the_scalarlm_client(llm, trainer):
    examples = EXAMPLES + [{"input": "client", "output": "train"}]
    reply = llm.train(examples, train_args={"max_steps": 7, "learning_rate": 1e-3})
    job_hash = reply["job_status"]["model_name"]
    params = {"max_steps": 7, "learning_rate": 1e-3, "llm_name": BASE_MODEL}
    # Our hash: canonical params (llm_name filled in) + the uncompressed dataset, not the gzip bytes.
    assert job_hash == hash_job(params, sha256(jsonlines(examples)))
    assert reply["job_status"]["status"] == "QUEUED" and reply["deployed"] is False
    assert reply["job_status"]["job_directory"].endswith(job_hash)
    assert reply["job_config"]["llm_name"] == BASE_MODEL
    assert reply["job_config"]["dataset_hash"] == sha256(jsonlines(examples))
    [got] = [r for r in trainer.submits if r.submit.job_hash == job_hash]
    assert got.dataset == jsonlines(examples) and got.submit.examples == 3 and got.code is None

    for name in (job_hash, job_hash[:12], "latest"):
        fetched = llm.get_training_job(name)
        assert fetched["job_status"]["model_name"] == job_hash and fetched["job_config"]["max_steps"] == 7
    listed = llm.list_models()["models"]
    assert listed[0]["name"] == job_hash and listed[0]["status"] == "QUEUED"
    assert set(listed[0]) == {"name", "deployed", "status", "start_time", "step", "max_steps",
                              "train_time", "loss"}


def test_same_data_twice_is_one_job_and_one_stored_dataset(llm, trainer):
    examples = EXAMPLES + [{"input": "twice", "output": "once"}]
    # The client's tar.gz differs on every call (gzip header: temp file name, mtime); the job does not.
    first = llm.train(examples, train_args={"max_steps": 2})
    second = llm.train(examples, train_args={"max_steps": 2})
    job_hash = first["job_status"]["model_name"]
    assert second["job_status"]["model_name"] == job_hash
    assert [r.submit.job_hash for r in trainer.submits].count(job_hash) == 1
    # New params, same data: a new job that reuses the stored dataset object instead of writing it.
    dataset = sha256(jsonlines(examples))
    before = trainer.dataset_info(dataset)
    other = llm.train(examples, train_args={"max_steps": 3})
    assert other["job_status"]["model_name"] != job_hash
    assert trainer.submits[-1].submit.dataset_sha256 == dataset
    assert trainer.dataset_info(dataset).nuid == before.nuid


def test_ml_code_travels_as_its_own_object(llm, trainer, tmp_path):
    (tmp_path / "ml" / "cray_megatron").mkdir(parents=True)
    (tmp_path / "ml" / "cray_megatron" / "main.py").write_text("print('my loop')\n")
    reply = llm.train(EXAMPLES, train_args={"max_steps": 4})
    got = trainer.submits[-1]
    assert got.submit.job_hash == reply["job_status"]["model_name"] and got.code is not None
    assert got.submit.code_sha256 == sha256(got.code)
    assert b"print('my loop')" in got.code


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
    assert body["job_status"]["model_name"] == hash_job(params, sha256(jsonlines(EXAMPLES)))


@pytest.mark.parametrize("params, field", [
    ({"max_steps": 0}, "params.max_steps"),
    ({"learning_rate": "fast"}, "params.learning_rate"),
    ({"lora_config": {"r": 8.5}}, "params.lora_config.r"),
    ({"adapter_type": "dora"}, "params.adapter_type"),
    ({"tensor_parallel": 2, "adapter_type": "lora"}, "params"),
])
def test_bad_params_are_a_422_naming_the_field_before_anything_is_stored(http, trainer, params, field):
    from nats.js.errors import NotFoundError

    examples = EXAMPLES + [{"input": "refused", "output": field}]
    resp = post_train(http, archive({DATASET_FILE: jsonlines(examples)}), params)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"].startswith(f"{field}: "), resp.json()["detail"]
    with pytest.raises(NotFoundError):
        trainer.dataset_info(sha256(jsonlines(examples)))


def test_params_that_mean_the_same_are_one_job(http, trainer):
    data = jsonlines(EXAMPLES + [{"input": "canonical", "output": "params"}])
    first = post_train(http, data, {"max_steps": 4, "seed": None, "adapter_type": "LoRA", "gpus": 2}).json()
    second = post_train(http, data, {"adapter_type": "lora", "gpus": 2, "max_steps": 4}).json()
    job_hash = first["job_status"]["model_name"]
    assert second["job_status"]["model_name"] == job_hash
    params = {"max_steps": 4, "adapter_type": "lora", "gpus": 2, "llm_name": BASE_MODEL}
    assert job_hash == hash_job(params, sha256(data))
    # What the client sent beyond our params is kept (it is part of the job) and shown back.
    assert first["job_config"]["gpus"] == 2 and first["job_config"]["adapter_type"] == "lora"
    assert trainer.submits[-1].submit.params.model_dump(mode="json", exclude_unset=True) == params


def test_cancel_restart_delete_pass_the_trainer_through(llm, http, trainer):
    job_hash = llm.train(EXAMPLES, train_args={"max_steps": 9})["job_status"]["model_name"]
    resp = http.post(f"/v1/megatron/restart/{job_hash}")
    assert resp.status_code == 409 and "QUEUED" in resp.json()["detail"]
    assert llm.cancel(job_hash)["job_status"]["status"] == "CANCELLED"
    assert http.post(f"/v1/megatron/restart/{job_hash}").json()["job_status"]["model_name"] == job_hash
    assert llm.delete(job_hash)["job_status"]["model_name"] == job_hash
    assert http.get(f"/v1/megatron/train/{job_hash}").status_code == 404


def test_cluster_routes(llm, http):
    assert llm.get_gpu_count() == 0 and llm.get_node_count() == 1
    assert "JOBID" in http.get("/v1/megatron/squeue").json()["squeue_output"]


def test_logs_as_the_scalarlm_cli_reads_them(llm, gateway, trainer, monkeypatch):
    job_hash = llm.train(EXAMPLES, train_args={"max_steps": 11})["job_status"]["model_name"]
    trainer.logs[job_hash] = [f"step {i} loss {1.0 / (i + 1):.3f}" for i in range(5)]
    trainer.emit(job_hash, "completed")
    monkeypatch.setenv("SCALARLM_API_URL", gateway.url)
    lines = asyncio.run(view_logs.sample_log_stream(model_name=job_hash, starting_line_number=2))
    assert [(x["line_number"], x["line"]) for x in lines] == [(i, f"step {i} loss {1.0 / (i + 1):.3f}")
                                                              for i in range(2, 5)]


def test_logs_follow_a_running_job_until_it_ends(llm, http, trainer):
    job_hash = llm.train(EXAMPLES, train_args={"max_steps": 12})["job_status"]["model_name"]
    trainer.emit(job_hash, "started")
    trainer.logs[job_hash] = ["first"]
    with http.stream("GET", f"/v1/megatron/train/logs/{job_hash}") as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.iter_lines()
        assert json.loads(next(lines)) == {"line": "first", "line_number": 0}
        trainer.logs[job_hash].append("second")
        trainer.emit(job_hash, "completed")
        rest = [json.loads(line) for line in lines if line]
    assert rest == [{"line": "second", "line_number": 1}]
    snapshot = http.get(f"/v1/megatron/train/logs/{job_hash}", params={"follow": "false"})
    assert [json.loads(x)["line"] for x in snapshot.text.splitlines()] == ["first", "second"]


def test_no_trainer_is_503(http, trainer):
    trainer.run(trainer.service.stop())
    try:
        resp = http.get("/v1/megatron/list_models")
        assert resp.status_code == 503 and "trainer is not running" in resp.json()["detail"]
        assert post_train(http, jsonlines(EXAMPLES), {"max_steps": 99}).status_code == 503
    finally:
        trainer.run(trainer.start_service())
    assert http.get("/v1/megatron/list_models").status_code == 200
