"""One serving stack (tiny model, vLLM where installed) shared by the end-to-end tests that only
read from it; tests that break things start their own."""

from __future__ import annotations

import pytest

from support.early_release import release_after_last_use
from support.stacks import SLURM_TINKER_IDLE_TTL_S, make_stack, tiny_model


@pytest.fixture(scope="session")
def tiny():
    return tiny_model()


@pytest.fixture(scope="session")
def stack(tmp_path_factory, tiny, request):
    s = make_stack(tmp_path_factory.mktemp("stack"), tiny)
    s.start()
    release_after_last_use(request, s.stop)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def two_deployments_stack(tmp_path_factory, request):
    """The tiny generation model and the tiny embedding model side by side, each its own deployment
    (``LOOPLINE_MODEL=tiny,tiny-embed``): test_deployments reads from it, test_embedding_training
    trains an embedding adapter that its embedding deployment serves, then the fuzz run (which
    clears the queue and cancels whatever job a random name matches) has it to itself; a short
    context bounds each fuzz case (test_fuzz.py)."""
    s = make_stack(tmp_path_factory.mktemp("two-deployments"), "tiny,tiny-embed",
                   LOOPLINE_MAX_MODEL_LEN="256")
    s.start()
    release_after_last_use(request, s.stop)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def slurm_stack(tmp_path_factory, tiny, slurm, request):
    """A stack whose trainer submits to the session's Slurm cluster (training jobs and Tinker session
    workers), shared by the modules that only add their own jobs and workers to it; each module
    cancels what it left in Slurm (``slurm.cancel_all()``) when it ends."""
    s = make_stack(tmp_path_factory.mktemp("slurm-stack"), tiny, LOOPLINE_LAUNCHER="slurm",
                   LOOPLINE_RECONCILE_INTERVAL_S="0.25",
                   LOOPLINE_TINKER_IDLE_TTL_S=str(SLURM_TINKER_IDLE_TTL_S), **slurm.env)
    s.start()
    release_after_last_use(request, s.stop)
    yield s
    s.stop()
    slurm.cancel_all()


@pytest.fixture(scope="session")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="session")
def tinker_stack(tmp_path_factory, tiny, request):
    """A stack for the Tinker API tests: its session workers run under the local launcher (the
    Slurm one has its own test), reconciled often so a dead worker is noticed within a second, and
    share passes between clients as they do on a GPU (so every Tinker test here runs that path
    wherever its calls meet another client's)."""
    s = make_stack(tmp_path_factory.mktemp("tinker-stack"), tiny, LOOPLINE_LAUNCHER="local",
                   LOOPLINE_RECONCILE_INTERVAL_S="0.25", LOOPLINE_TINKER_SHARED_PASSES="true")
    s.start()
    release_after_last_use(request, s.stop)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def service(tinker_stack, request):
    """The unmodified tinker SDK's ServiceClient, pointed at the stack."""
    import tinker

    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_TELEMETRY", "0")
    # Closed on exit (the session finished): no heartbeat thread outlives the stack.
    with tinker.ServiceClient(base_url=tinker_stack.url, api_key="tml-loopline-test") as service:
        release_after_last_use(request, lambda: service.close("success").result())
        yield service
    mp.undo()
