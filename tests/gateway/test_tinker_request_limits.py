"""The gateway bounds what one key's Tinker requests make elsewhere, before it hands them on: a
``forward_backward`` whose data would expand past ``LOOPLINE_TINKER_MAX_REQUEST_BYTES`` dense is
400 before it is published to a session worker (which checks again: tests/tinker_worker/
test_request_bounds.py), and a key holding ``LOOPLINE_MAX_TINKER_MODELS_PER_KEY`` live training
clients gets 429 (which the SDK does not retry) for one more, by ``create_model`` or from saved
state. The gateway's peak RSS stays within RSS_BOUND while it refuses.

Real parts: nats-server and the gateway as its own process with a keys file (three training keys),
the unmodified SDK; the records the trainer and the workers would have written are put on the bus
(support/tinker_records.py), and the base model is a MODELS record with a census replica. No
trainer runs: a request let through is answered 503 when it would be placed, after every check.
"""

from __future__ import annotations

import time

import httpx
import pytest
from tinker import types as tt
from tinker.proto.request_conv import forward_backward_request_to_proto

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import DeploymentInfo
from loopline.common.local import launcher
from loopline.gateway.auth.key_store import KeyEntry, KeyFile, key_hash, new_key, write_key_file
from support import tinker_records as records
from support.census_replica import census_replica
from support.gateway_process import start_gateway
from support.peak_rss import PeakRss
from support.tinker_records import TinkerBus

MiB = 1024 * 1024
MAX_REQUEST_BYTES = 8 * MiB
MAX_MODELS = 2
# What one refused request may add to the gateway's peak RSS: its body, parsed, and the answer.
RSS_BOUND = 40 * MiB
KEYS = {name: new_key() for name in ("a", "b", "c")}
BASE = DeploymentInfo(model=records.BASE, deployment="limits-base", max_model_len=2048, engine="vllm",
                      max_adapter_rank=32, model_path="/models/base")


@pytest.fixture(scope="module")
def gateway(nats_proc, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api_keys.json"
    scopes = ["training", "inference"]
    write_key_file(path, KeyFile(keys=[KeyEntry(name=name, sha256=key_hash(key), scopes=scopes)
                                       for name, key in KEYS.items()]))
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("tinker-limits"),
                       LOOPLINE_API_KEYS_FILE=str(path),
                       LOOPLINE_TINKER_MAX_REQUEST_BYTES=str(MAX_REQUEST_BYTES),
                       LOOPLINE_MAX_TINKER_MODELS_PER_KEY=str(MAX_MODELS))
    with census_replica(nats_proc.info["url"], BASE, "limits-replica"):
        yield gw
    launcher.stop(gw.proc)


@pytest.fixture(scope="module")
def tinker_bus(nats_proc, gateway) -> TinkerBus:
    return TinkerBus(nats_proc.info["url"], "tinker-limits-test")


def client(gw, name: str) -> httpx.Client:
    return httpx.Client(base_url=gw.url, timeout=30, headers={"X-API-Key": KEYS[name]})


def sparse(rows: int, width: int) -> tt.TensorData:
    """A [rows, width] int64 CSR tensor storing nothing: 8 bytes a row on the wire."""
    return tt.TensorData(data=[], dtype="int64", shape=[rows, width], sparse_crow_indices=[0] * (rows + 1),
                         sparse_col_indices=[])


def forward_backward_body(model_id: str, width: int, datums: int = 1) -> bytes:
    """What the SDK posts for ``datums`` soft-target datums of 2048 tokens and ``width`` candidates."""
    data = [tt.Datum(model_input=tt.ModelInput.from_ints([1] * 2048), loss_fn_inputs={
        "target_tokens": sparse(2048, width)}) for _ in range(datums)]
    request = tt.ForwardBackwardRequest(forward_backward_input=tt.ForwardBackwardInput(
        data=data, loss_fn="cross_entropy"), model_id=model_id, seq_id=1)
    return bytes(forward_backward_request_to_proto(request).SerializeToString())


def calls_on(tinker_bus: TinkerBus, worker_id: str) -> int:
    async def count(nc) -> int:
        info = await nc.jetstream().stream_info(subjects.TINKER_CALLS_STREAM,
                                                subjects_filter=subjects.tinker_calls(worker_id))
        return sum((info.state.subjects or {}).values())

    return tinker_bus.ask(count)


def test_a_forward_backward_expanding_past_the_limit_is_400_before_a_worker_sees_it(gateway, tinker_bus):
    """Before: the gateway read only the routing fields and published any body; a worker then
    densified it (one datum of [512, 131072] held 768 MiB there, four grew it by 7 GB)."""
    session, worker = records.session(owner="c"), records.worker()
    model = records.model(session, worker, owner="c")
    tinker_bus.put(session, worker, model)
    over = forward_backward_body(model.model_id, width=1024)  # 2048 x 1024 x 8 bytes: 16 MiB dense
    with client(gateway, "c") as http, PeakRss(gateway.proc.pid) as rss:
        refused = http.post("/api/v1/forward_backward", content=over,
                            headers={"Content-Type": "application/x-protobuf"})
    assert refused.status_code == 400, refused.text
    dense = 2048 * 4 + 2048 * 1024 * 8
    assert f"expand to {2048 + 2048 * 1024} cells ({dense} bytes) dense" in refused.text
    assert f"the limit is {MAX_REQUEST_BYTES}" in refused.text
    assert "LOOPLINE_TINKER_MAX_REQUEST_BYTES" in refused.text
    assert rss.growth < RSS_BOUND, rss.growth
    assert calls_on(tinker_bus, worker.worker_id) == 0

    # Under the limit the call goes on to the worker's subject.
    with client(gateway, "c") as http:
        under = forward_backward_body(model.model_id, width=256)  # 4 MiB dense
        taken = http.post("/api/v1/forward_backward", content=under,
                          headers={"Content-Type": "application/x-protobuf"})
    assert taken.status_code == 200, taken.text
    assert calls_on(tinker_bus, worker.worker_id) == 1


def create_model(http: httpx.Client, session_id: str) -> httpx.Response:
    return http.post("/api/v1/create_model", json={
        "session_id": session_id, "model_seq_id": 5, "base_model": records.BASE,
        "lora_config": {"rank": 8, "train_unembed": False}})


def test_a_key_holding_the_most_live_training_clients_gets_429_for_another(gateway, tinker_bus):
    """Before: each create_model placed one more LoRA on the shared worker, without a limit per key
    (the daily quota counts sessions, not models). Released and failed clients, and another key's,
    do not count."""
    worker = records.worker()
    mine, theirs = records.session(owner="a"), records.session(owner="b")
    live = [records.model(mine, worker, seq, owner="a") for seq in range(MAX_MODELS)]
    gone = [records.model(mine, worker, MAX_MODELS + 1, owner="a", state="released"),
            records.model(mine, worker, MAX_MODELS + 2, owner="a", state="failed")]
    tinker_bus.put(mine, theirs, worker, *live, *gone, records.model(theirs, worker, 0, owner="b"))
    saved = records.checkpoint(live[0], "weights", "first")
    tinker_bus.put(saved)

    with client(gateway, "a") as http, PeakRss(gateway.proc.pid) as rss:
        refused = create_model(http, mine.session_id)
        from_state = http.post("/api/v1/load_weights", json={
            "path": saved.tinker_path, "session_id": mine.session_id, "model_seq_id": 6, "optimizer": False})
    for answer in (refused, from_state):
        assert answer.status_code == 429, answer.text
        assert "key 'a' holds 2 live training clients" in answer.text
        assert f"the limit is {MAX_MODELS}" in answer.text
        assert "LOOPLINE_MAX_TINKER_MODELS_PER_KEY" in answer.text
        assert answer.headers["x-should-retry"] == "false"
    assert rss.growth < RSS_BOUND, rss.growth

    # Key b holds one: its create_model passes every check and is only then placed (no trainer here).
    with client(gateway, "b") as http:
        placed = create_model(http, theirs.session_id)
    assert placed.status_code in (503, 504), placed.text
    assert "LOOPLINE_MAX_TINKER_MODELS_PER_KEY" not in placed.text


def test_the_sdk_fails_fast_on_the_models_limit(gateway, tinker_bus):
    """The SDK retries a 429; told not to, it raises at once with the limit's message."""
    import tinker

    session, worker = records.session(owner="a"), records.worker()
    tinker_bus.put(session, worker, *[records.model(session, worker, seq, owner="a")
                                      for seq in range(MAX_MODELS)])
    started = time.monotonic()
    with (tinker.ServiceClient(base_url=gateway.url, api_key=KEYS["a"]) as service,
          pytest.raises(tinker.RateLimitError, match="LOOPLINE_MAX_TINKER_MODELS_PER_KEY")):
        service.create_lora_training_client(base_model=records.BASE, rank=8, train_unembed=False).result()
    assert time.monotonic() - started < 10
