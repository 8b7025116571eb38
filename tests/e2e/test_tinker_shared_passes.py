"""Clients stepping at once on one session worker share its passes and get what each would alone.

The stack's workers share passes (``LOOPLINE_TINKER_SHARED_PASSES``, on a GPU by default). Two
clients drawn from one seed take the same steps at once while a third client's long call keeps the
worker busy, so both of their calls are waiting when it is done and run in one pass; a third client
of the same seed takes the steps alone. Their losses must agree step by step.
"""

from __future__ import annotations

import time

import pytest
from tinker import types

from loopline.common.contracts import tinker_names
from support.tinker_data import token_rows_data

STEPS = 3
ADAM = types.AdamParams(learning_rate=1e-2)


def worker_logs(stack) -> str:
    from loopline.trainer import jobdir

    workers = tinker_names.worker_dir(stack.jobs_dir, "x").parent
    return "".join(log.read_text() for folder in workers.iterdir() if folder.is_dir()
                   for log in jobdir.log_files(folder))


@pytest.mark.slow
def test_clients_stepping_at_once_share_a_pass_and_get_what_each_would_alone(service, tinker_stack, tiny):
    data = token_rows_data(vocab=1000, rows=4, length=32, seed=1)
    busy_data = token_rows_data(vocab=1000, rows=256, length=128, seed=2)
    together = [service.create_lora_training_client(base_model=tiny, rank=8, seed=77) for _ in range(2)]
    alone = service.create_lora_training_client(base_model=tiny, rank=8, seed=77)
    busy = service.create_lora_training_client(base_model=tiny, rank=8, seed=78)
    for step in range(STEPS):
        hold = busy.forward_backward(busy_data, "cross_entropy")  # the worker is busy with this...
        time.sleep(0.2)
        passes = [c.forward_backward(data, "cross_entropy") for c in together]  # ...while these arrive
        steps = [c.optim_step(ADAM) for c in together]
        hold.result()
        shared = [p.result().metrics["loss:sum"] for p in passes]
        for s in steps:
            s.result()
        solo = alone.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        alone.optim_step(ADAM).result()
        assert shared == pytest.approx([solo, solo], rel=1e-5), step
    assert "forward_backward of 2 models in shared passes" in worker_logs(tinker_stack)
