"""Tinker session workers where training runs: a real Slurm cluster runs them. A worker serves
several clients of one base model; one whose clients all idle past the TTL releases its allocation;
one that dies fails the calls it left unanswered with a clear error, and a client made from the
last saved state carries on, on a new worker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from loopline.common.contracts.tinker_schemas import TinkerModel, TinkerWorker
from loopline.common.runtime import bus
from loopline.common.runtime.tinker_store import TinkerStore
from support.stacks import SLURM_TINKER_IDLE_TTL_S

IDLE_TTL_S = SLURM_TINKER_IDLE_TTL_S  # the session's Slurm stack (conftest.py's slurm_stack)


@pytest.fixture(scope="module", autouse=True)
def cancel_what_is_left(slurm):
    """The Slurm stack is shared: leave no session worker of ours in it."""
    yield
    slurm.cancel_all()


@pytest.fixture(scope="module")
def sdk(slurm_stack):
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    with tinker.ServiceClient(base_url=slurm_stack.url, api_key="tml-loopline-test") as service:
        yield service  # closed on exit: no heartbeat thread outlives the stack


def records(stack, model_id: str) -> tuple[TinkerModel, TinkerWorker]:
    async def read():
        nc = await bus.connect(stack.nats_url, "test-tinker-records")
        try:
            store = TinkerStore(nc.jetstream(), nc.max_payload)
            await store.start()
            model = await store.model(model_id)
            assert model is not None
            worker = await store.worker(model.worker_id)
            assert worker is not None
            return model, worker
        finally:
            await nc.close()

    return asyncio.run(read())


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def worker_pid(worker_id: str) -> int:
    """The session worker's process, found by the id in its environment (Slurm started it)."""
    needle = f"LOOPLINE_TINKER_WORKER_ID={worker_id}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"loopline.tinker_worker" in (proc / "cmdline").read_bytes() and \
                    needle in (proc / "environ").read_bytes().split(b"\0"):
                return int(proc.name)
        except OSError:
            continue
    raise AssertionError(f"no process of session worker {worker_id}")


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:]})


def step(client, data) -> None:
    fwd = client.forward_backward(data, "cross_entropy")
    opt = client.optim_step(types.AdamParams(learning_rate=1e-2))
    fwd.result()
    opt.result()


def test_a_slurm_worker_serves_clients_then_dies_and_they_resume_from_saved_state(sdk, tiny, slurm_stack,
                                                                                  slurm):
    first = sdk.create_lora_training_client(base_model=tiny, rank=4, seed=1).result()
    second = sdk.create_lora_training_client(base_model=tiny, rank=4, seed=2).result()
    data = [datum(first.get_tokenizer().encode("Loopline trains on Slurm."))]
    step(first, data)
    step(second, data)
    _, worker = records(slurm_stack, first.model_id)
    assert worker.launcher == "slurm" and worker.run_id
    assert records(slurm_stack, second.model_id)[1].worker_id == worker.worker_id  # one resident base
    assert worker.run_id in slurm.run("squeue", "-h", "-o", "%i").stdout.split()
    saved = first.save_state("before-death").result().path
    expected = first.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()

    # A call in flight when the worker dies: stopped, it cannot answer; killed, it never will.
    pid = worker_pid(worker.worker_id)
    os.kill(pid, signal.SIGSTOP)
    pending = first.forward_backward(data, "cross_entropy")
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(Exception, match="session worker") as failure:
        pending.result(timeout=60)
    assert "create_training_client_from_state" in str(failure.value)
    wait_for(lambda: records(slurm_stack, first.model_id)[0].state == "failed", 30, "the model marked failed")

    resumed = sdk.create_training_client_from_state_with_optimizer(saved).result()
    assert records(slurm_stack, resumed.model_id)[1].worker_id != worker.worker_id
    got = resumed.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert np.allclose(got, expected, atol=1e-5)
    step(resumed, data)

    # Idle past the TTL: the client is released, then the worker, and its allocation is freed.
    _, new_worker = records(slurm_stack, resumed.model_id)
    wait_for(lambda: records(slurm_stack, resumed.model_id)[1].state == "released", IDLE_TTL_S + 60,
             "the idle worker released")
    assert new_worker.run_id not in slurm.run("squeue", "-h", "-o", "%i").stdout.split()
    with pytest.raises(Exception, match="released"):
        resumed.forward(data, "cross_entropy").result(timeout=30)
