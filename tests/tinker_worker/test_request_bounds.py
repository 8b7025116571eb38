"""Every allocation a forward_backward body causes on the session worker is bounded before it is
made (the shared worker holds every tenant's unsaved clients): its total dense size
(``LOOPLINE_TINKER_MAX_REQUEST_BYTES``), each datum's length against the model's context, each 2-D
input's width against its vocabulary; the clients one worker holds (``LOOPLINE_TINKER_MAX_CLIENTS``);
and the padding of soft targets in a micro-batch.

The bodies are what the SDK's own ``request_conv`` writes for sparse ``TensorData``: a few hundred
kilobytes on the wire that claim hundreds of megabytes dense. Each goes through ``Calls.run``
(the worker's real path: the body packed in a real nats-server's store, then decoded) on the tiny
model (context 2048, vocabulary 1024), and this process's peak RSS is measured while it is refused.
"""

from __future__ import annotations

import math
import os
import uuid

import numpy as np
import pytest
from tinker import types as tt

from loopline.common.config.settings import TinkerWorkerSettings
from loopline.common.contracts.tinker_schemas import LoraSpec, StepCall, TinkerModel
from loopline.common.runtime.tinker_store import TinkerStore
from loopline.tinker_worker import batching, training
from loopline.tinker_worker.batching import micro_batches
from loopline.tinker_worker.calls import Calls
from support.peak_rss import PeakRss
from support.tinker_data import make_datum, sdk_body

MiB = 1024 * 1024
# What a refused body may add to this process's peak RSS: its protobuf, parsed, and the error.
# Unbounded, each body here costs 100 MB or more (noted per test).
RSS_BOUND = 40 * MiB
MAX_REQUEST_BYTES = 32 * MiB
# For the checks that come before the total's: a limit none of their bodies reaches.
LARGE_LIMIT = 1024 * MiB
WORKER_ID = "w-bounds"
PAGE = 4096


def sparse(rows: int, width: int, dtype: tt.TensorDtype) -> tt.TensorData:
    """A [rows, width] CSR tensor storing a 0 in every memory page of its dense form, so that
    densified it is resident whole: ~20 bytes on the wire for each page it claims."""
    cols = list(range(0, width, PAGE // (8 if dtype == "int64" else 4)))
    return tt.TensorData(data=[0] * (rows * len(cols)), dtype=dtype, shape=[rows, width],
                         sparse_crow_indices=[len(cols) * r for r in range(rows + 1)],
                         sparse_col_indices=cols * rows)


def soft_datum(tokens: int, width: int) -> tt.Datum:
    return tt.Datum(model_input=tt.ModelInput.from_ints([1] * tokens), loss_fn_inputs={
        "target_tokens": sparse(tokens, width, "int64"), "weights": sparse(tokens, width, "float32")})


@pytest.fixture
async def store(nc):
    store = TinkerStore(nc.jetstream(), nc.max_payload)
    await store.start()
    return store


def calls_of(clients, nc, store: TinkerStore, max_request_bytes: int) -> Calls:
    settings = TinkerWorkerSettings(tinker_worker_id=WORKER_ID, tinker_max_request_bytes=max_request_bytes)
    return Calls(settings, clients, store, nc, store.js, emit=lambda event: None)


@pytest.fixture
def calls(clients, nc, store):
    return calls_of(clients, nc, store, MAX_REQUEST_BYTES)


@pytest.fixture
def roomy_calls(clients, nc, store):
    return calls_of(clients, nc, store, LARGE_LIMIT)


def model_record() -> TinkerModel:
    model_id = f"{uuid.uuid4().hex}:train:0"
    return TinkerModel(model_id=model_id, session_id="s", base_model="tiny", model_path="/tiny",
                       model_name="tiny", lora=LoraSpec(rank=2, seed=0), worker_id=WORKER_ID)


async def refused(calls: Calls, data: list[tt.Datum]) -> str:
    """The user error ``data``'s forward_backward gets, once its run has added less than RSS_BOUND to
    this process's peak RSS."""
    model = model_record()
    calls.clients.create(model.model_id, model.lora)
    try:
        body = sdk_body(data, seq_id=1)
        call = StepCall(request_id=f"{model.model_id}:1:fb", model_id=model.model_id, seq_id=1,
                        kind="forward_backward", proto=await calls.store.pack(f"call-{model.model_id}", body))
        with PeakRss(os.getpid()) as rss:
            result = await calls.run(call, model)
    finally:
        calls.clients.drop(model.model_id)
    assert rss.growth < RSS_BOUND, f"{rss.growth / MiB:.0f} MiB"
    assert result is not None and not result.ok, result
    assert result.category == "user", result.error
    return str(result.error)


async def test_a_request_that_expands_past_the_limit_is_refused_before_any_of_it_is_made(calls):
    """Before: no bound on the request as a whole; these 8 datums of [2048, 1024] (within the
    context and the vocabulary, under 1 MB on the wire) were densified to 192 MiB and trained on."""
    error = await refused(calls, [soft_datum(2048, 1024) for _ in range(8)])
    assert "LOOPLINE_TINKER_MAX_REQUEST_BYTES" in error and f"the limit is {MAX_REQUEST_BYTES} bytes" in error
    dense = 8 * (2048 * 4 + 2048 * 1024 * (8 + 4))  # tokens as int32, targets int64, weights float32
    assert f"({dense} bytes) dense" in error


async def test_a_datum_longer_than_the_context_is_refused_before_its_inputs_are_made(roomy_calls):
    """Before: its sparse inputs were densified first (3000 x 1024 x 12 bytes: 35 MiB a datum), and
    only then was its length found to be over the context."""
    error = await refused(roomy_calls, [soft_datum(3000, 1024), soft_datum(3000, 1024)])
    assert "data[0]: 3000 tokens, more than the model's context of 2048" in error


async def test_an_input_wider_than_the_vocabulary_is_refused(roomy_calls):
    """The issue's attack in small: soft targets of more candidates than the vocabulary holds.
    Before: densified (16 x 200000 x 12 bytes: 37 MiB, copied again by the loss's checks) and
    trained on; four datums of [512, 131072] grew a worker by 7 GB."""
    error = await refused(roomy_calls, [soft_datum(16, 200_000)])
    assert error.startswith("data[0].loss_fn_inputs[") and "shape [16, 200000] has 200000 candidates" in error
    assert "vocabulary of 1024 tokens" in error


async def test_a_worker_refuses_a_client_beyond_its_limit_and_fails_its_record(calls, monkeypatch):
    """Before: every create_model added a LoRA (and its AdamW state) to the shared worker, without
    a limit. Now the one past ``LOOPLINE_TINKER_MAX_CLIENTS`` is a user error, its record is failed
    (its later calls are answered at once), and nothing of it is made."""
    held = len(calls.clients.models())
    monkeypatch.setattr(calls.clients, "max_clients", held + 1)
    first, extra = model_record(), model_record()
    await calls.store.put_model(extra)
    try:
        assert (await calls.run(create(first), first)).ok
        with PeakRss(os.getpid()) as rss:
            result = await calls.run(create(extra), extra)
        assert rss.growth < RSS_BOUND, f"{rss.growth / MiB:.0f} MiB"
        assert result is not None and not result.ok and result.category == "user"
        assert "LOOPLINE_TINKER_MAX_CLIENTS" in str(result.error)
        assert f"the limit is {held + 1}" in str(result.error)
        assert extra.model_id not in calls.clients.models() and len(calls.clients.models()) == held + 1
        record = await calls.store.model(extra.model_id)
        assert record is not None and record.state == "failed"
        assert "LOOPLINE_TINKER_MAX_CLIENTS" in str(record.error)
        # A released client makes room for another.
        calls.release(first.model_id)
        retried = model_record()
        assert (await calls.run(create(retried), retried)).ok
        calls.release(retried.model_id)
    finally:
        calls.release(first.model_id)


def create(model: TinkerModel) -> StepCall:
    return StepCall(request_id=f"{model.model_id}:create", model_id=model.model_id, kind="create_model")


def test_a_wide_soft_target_datum_does_not_pad_its_whole_micro_batch():
    """Before: a micro-batch padded every row to its widest K, so one datum of K = 152k among 1023
    of K = 1 (155k cells in the request) made (1024, 1, 152k) targets, 1.2 GB. Now the wide one
    goes in a micro-batch of its own."""
    assert micro_batches([1] * 5, 4, [5000, 1, 1, 1, 1]) == [[0], [1, 2, 3, 4]]
    assert micro_batches([1] * 5, 4, [2, 1, 1, 1, 1]) == [[0, 1, 2, 3], [4]]  # narrow: as before


async def test_padded_targets_stay_within_their_budget_in_a_real_pass(clients, new_id, monkeypatch):
    """On the tiny model (vocabulary 1024, so every K fits the real MAX_PADDED_WIDTH) with a width
    budget of 4: every micro-batch's padded targets hold at most budget x micro-batch tokens cells."""
    monkeypatch.setattr(batching, "MAX_PADDED_WIDTH", 4)
    shapes: list[tuple[int, ...]] = []

    def recording_build(*args, **kwargs):
        batch = batching.build(*args, **kwargs)
        shapes.append(tuple(batch.targets.shape))
        return batch

    monkeypatch.setattr(training, "build", recording_build)
    wide = make_datum([1, 2], {"target_tokens": np.zeros((2, 512), np.int64),
                               "weights": np.ones((2, 512), np.float32)})
    narrow = [make_datum([1, 2], {"target_tokens": np.array([3, 4]), "weights": np.ones(2, np.float32)})
              for _ in range(20)]
    model_id = new_id()
    clients.create(model_id, LoraSpec(rank=2, seed=0))
    try:
        clients.forward_backward(model_id, [wide, *narrow], "cross_entropy", forward_only=True)
    finally:
        clients.drop(model_id)
    assert sum(shape[0] for shape in shapes) == 21
    assert max(math.prod(shape) for shape in shapes) <= 4 * clients.micro_batch_tokens, shapes
