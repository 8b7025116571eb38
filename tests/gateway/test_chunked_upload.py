"""ScalarLM's chunked training upload (init, chunk, finalize) against a real gateway process, and
behind two gateways with no sticky session: the chunks live in NATS, so each may go to either gateway
and either finalizes."""

from __future__ import annotations

import hashlib
import random
import time

import httpx
import pytest
import scalarlm
from masint.engines.cray import submit_training_job
from nats.js.object_store import OBJ_STREAM_TEMPLATE

from loopline.common.contracts import subjects
from loopline.common.contracts.job_hash import job_hash as hash_job
from loopline.common.contracts.job_layout import DATASET_FILE
from loopline.common.local import launcher
from support.bus_view import BusView
from support.gateway_process import BASE_MODEL, MAX_CHUNK_BYTES, start_gateway
from support.nats import nats_server
from support.training_data import archive, jsonlines, sha256

CHUNK = 4096


def varied_examples(n: int, seed: int) -> list[dict]:
    # Random words, so the tar.gz does not shrink into a single chunk.
    rng = random.Random(seed)

    def word() -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))

    return [{"input": " ".join(word() for _ in range(12)), "output": word()} for _ in range(n)]


def init(http, data: bytes, params: dict, chunk: int = CHUNK):
    body = {"total_size": len(data), "total_hash": sha256(data), "chunk_size": chunk,
            "num_chunks": -(-len(data) // chunk), "compressed": True, "params": params}
    resp = http.post("/v1/megatron/upload/init", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def send(http, upload_id: str, index: int, data: bytes, digest: str | None = None):
    headers = {"X-Upload-Id": upload_id, "X-Chunk-Index": str(index),
               "X-Chunk-Hash": digest or hashlib.sha256(data).hexdigest(),
               "Content-Type": "application/octet-stream"}
    return http.post("/v1/megatron/upload/chunk", content=data, headers=headers)


def test_the_scalarlm_client_uploads_in_chunks(gateway, trainer, tmp_path, monkeypatch):
    # The client's own switches (MASINT_SINGLE_POST_THRESHOLD, MASINT_UPLOAD_CHUNK_SIZE), set small.
    monkeypatch.setattr(submit_training_job, "_SINGLE_POST_THRESHOLD", 0)
    monkeypatch.setattr(submit_training_job, "_UPLOAD_CHUNK_SIZE", CHUNK)
    monkeypatch.chdir(tmp_path)
    examples = varied_examples(300, seed=1)
    llm = scalarlm.SupermassiveIntelligence(api_url=gateway.url)
    reply = llm.train(examples, train_args={"max_steps": 21})
    params = {"max_steps": 21, "llm_name": BASE_MODEL}
    assert reply["job_status"]["model_name"] == hash_job(params, sha256(jsonlines(examples)))
    # Reassembled, unpacked, stored, and fetched by the trainer into the job directory intact.
    job_dir = trainer.job_dir(reply["job_status"]["model_name"])
    assert (job_dir / DATASET_FILE).read_bytes() == jsonlines(examples)
    assert not list((gateway.state_dir / "uploads").iterdir())  # the staging is cleaned up


def test_bad_chunk_hash_is_422_and_a_retry_succeeds(http, trainer):
    data = archive({DATASET_FILE: jsonlines(varied_examples(200, seed=2))})
    chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
    assert len(chunks) >= 3
    params = {"max_steps": 22}
    session = init(http, data, params)
    upload_id = session["upload_id"]
    assert session["received_chunks"] == []

    damaged = bytes([chunks[0][0] ^ 1]) + chunks[0][1:]
    resp = send(http, upload_id, 0, damaged, digest=hashlib.sha256(chunks[0]).hexdigest())
    assert resp.status_code == 422 and "send it again" in resp.json()["detail"]
    resp = send(http, upload_id, 0, chunks[0])
    assert resp.status_code == 200
    assert resp.json() == {"upload_id": upload_id, "chunk_index": 0, "received": True,
                           "bytes_written": len(chunks[0])}

    assert send(http, upload_id, len(chunks), chunks[0]).status_code == 400  # out of range
    assert send(http, upload_id, 1, bytes(MAX_CHUNK_BYTES + 1)).status_code == 413
    assert send(http, "0" * 32, 0, chunks[0]).status_code == 404  # unknown upload
    assert send(http, "../../etc", 0, chunks[0]).status_code == 404  # not an id at all
    resp = http.post("/v1/megatron/upload/finalize", json={"upload_id": upload_id})
    assert resp.status_code == 409 and "have not arrived" in resp.json()["detail"]

    # Starting the same upload again resumes it.
    assert init(http, data, params) == {"upload_id": upload_id, "received_chunks": [0]}
    for index, chunk in enumerate(chunks[1:], start=1):
        assert send(http, upload_id, index, chunk).status_code == 200
    resp = http.post("/v1/megatron/upload/finalize", json={"upload_id": upload_id})
    assert resp.status_code == 200, resp.text
    job_hash = resp.json()["job_status"]["model_name"]
    assert (trainer.job_dir(job_hash) / DATASET_FILE).read_bytes() == jsonlines(varied_examples(200, seed=2))
    # Finalize is the same path as /train: the same archive posted whole is the same job.
    whole = http.post("/v1/megatron/train", files={"file": ("dataset", data)},
                      data={"params": '{"max_steps": 22}'})
    assert whole.json()["job_status"]["model_name"] == job_hash
    assert http.post("/v1/megatron/upload/finalize", json={"upload_id": upload_id}).status_code == 404


@pytest.mark.parametrize("change, status", [
    ({"chunk_size": MAX_CHUNK_BYTES + 1, "num_chunks": 1}, 413),
    ({"num_chunks": 99}, 422),
    ({"total_hash": "not-a-hash"}, 422),
    ({"params": {"max_steps": 0}}, 422),  # refused before a chunk is sent
    ({"total_hash": "A" * 64}, 200),  # hex digits of either case
])
def test_init_checks_what_the_client_declares(http, change, status):
    body = {"total_size": 1000, "total_hash": "a" * 64, "chunk_size": 1000, "num_chunks": 1, "params": {}}
    assert http.post("/v1/megatron/upload/init", json={**body, **change}).status_code == status


def test_a_corrupt_whole_is_422_and_a_bad_archive_is_refused_at_finalize(http):
    data = b"x" * 100
    session = init(http, data, {}, chunk=64)
    # Each chunk is intact, but init declared a different whole: the client's bug, told plainly.
    body = {"total_size": 100, "total_hash": "b" * 64, "chunk_size": 64, "num_chunks": 2, "params": {}}
    other = http.post("/v1/megatron/upload/init", json=body).json()["upload_id"]
    send(http, other, 0, data[:64])
    send(http, other, 1, data[64:])
    resp = http.post("/v1/megatron/upload/finalize", json={"upload_id": other})
    assert resp.status_code == 422 and "sha256" in resp.json()["detail"]
    # Hash right, content not a training archive: the same 4xx as /train gives.
    send(http, session["upload_id"], 0, data[:64])
    send(http, session["upload_id"], 1, data[64:])
    resp = http.post("/v1/megatron/upload/finalize", json={"upload_id": session["upload_id"]})
    assert resp.status_code == 422 and "line 1" in resp.json()["detail"]


@pytest.fixture(scope="module")
def second_gateway(nats_proc, trainer, tmp_path_factory):
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("gateway-b"))
    yield gw
    launcher.stop(gw.proc)


def uploads_held(nats_bus: BusView) -> int:
    """Messages (chunks and metadata) left in the uploads object store."""
    async def count(nc) -> int:
        info = await nc.jetstream().stream_info(OBJ_STREAM_TEMPLATE.format(bucket=subjects.UPLOADS_BUCKET))
        return info.state.messages
    return nats_bus.ask(count)


def test_chunks_alternate_between_gateways_and_the_second_finalizes(gateway, second_gateway, trainer,
                                                                     nats_bus):
    examples = varied_examples(250, seed=7)
    data = archive({DATASET_FILE: jsonlines(examples)})
    chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
    assert len(chunks) >= 4
    held_before = uploads_held(nats_bus)  # unfinished uploads of the tests above
    with httpx.Client(base_url=gateway.url, timeout=30) as a, \
            httpx.Client(base_url=second_gateway.url, timeout=30) as b:
        upload_id = init(a, data, {"max_steps": 23})["upload_id"]
        # Invariant: chunks 0..index-1 went to A (even) and B (odd), each accepted.
        for index, chunk in enumerate(chunks):
            resp = send((a, b)[index % 2], upload_id, index, chunk)
            assert resp.status_code == 200, resp.text
        # Either gateway knows what the other received: init again on B resumes with all of them.
        assert init(b, data, {"max_steps": 23}) == {"upload_id": upload_id,
                                                    "received_chunks": list(range(len(chunks)))}
        # A bad chunk is still refused by whichever gateway takes it, with the same statuses.
        damaged = bytes([chunks[0][0] ^ 1]) + chunks[0][1:]
        assert send(b, upload_id, 0, damaged, digest=hashlib.sha256(chunks[0]).hexdigest()).status_code == 422
        assert send(b, upload_id, len(chunks), chunks[0]).status_code == 400

        resp = b.post("/v1/megatron/upload/finalize", json={"upload_id": upload_id})
        assert resp.status_code == 200, resp.text
        job_hash = resp.json()["job_status"]["model_name"]
        dataset = (trainer.job_dir(job_hash) / DATASET_FILE).read_bytes()
        assert hashlib.sha256(dataset).hexdigest() == hashlib.sha256(jsonlines(examples)).hexdigest()
        # The same archive posted whole to A is the same job.
        whole = a.post("/v1/megatron/train", files={"file": ("dataset", data)},
                       data={"params": '{"max_steps": 23}'})
        assert whole.json()["job_status"]["model_name"] == job_hash
        # Finalized: gone from NATS, and neither gateway knows the upload any more.
        assert a.post("/v1/megatron/upload/finalize", json={"upload_id": upload_id}).status_code == 404
    assert uploads_held(nats_bus) == held_before
    for gw in (gateway, second_gateway):
        assert not list((gw.state_dir / "uploads").iterdir())  # nothing left on either disk


# Tier: waits out the upload TTL, ~6 s.
@pytest.mark.slow
def test_an_unfinished_upload_expires_after_the_ttl(tmp_path):
    """LOOPLINE_UPLOAD_TTL_S is the uploads store's TTL: an upload left unfinished goes by itself.
    (A nats-server of its own: the TTL applies to the store every gateway on it shares.)"""
    with nats_server(tmp_path) as nats:
        gw = start_gateway(nats.info["url"], tmp_path / "gw", LOOPLINE_UPLOAD_TTL_S="2")
        bus = BusView(nats.info["url"])
        try:
            _expires(gw, bus)
        finally:
            launcher.stop(gw.proc)


def _expires(gw, nats_bus: BusView) -> None:
    data = b"y" * 200
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        upload_id = init(http, data, {}, chunk=100)["upload_id"]
        assert send(http, upload_id, 0, data[:100]).status_code == 200
        assert uploads_held(nats_bus) > 0
        deadline = time.monotonic() + 20
        # Invariant: the upload's objects were all there at the last look.
        while uploads_held(nats_bus) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert uploads_held(nats_bus) == 0
        resp = send(http, upload_id, 1, data[100:])
        assert resp.status_code == 404 and "expired" in resp.json()["detail"]
