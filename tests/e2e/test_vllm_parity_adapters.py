"""Trained adapters answer through Loopline exactly as through ``vllm serve``: issue 14's item 5 for
a LoRA and a Tokenformer adapter.

A Loopline stack trains both (the unmodified ``scalarlm`` client, the trainer's local launcher) and
serves them by job hash. vLLM's own server then starts on the same model with the same flags plus
``--lora-modules <job hash>=<folder>``, the folder being the checkpoint converted as the replica
converts it (``to_vllm_lora``; the Tokenformer plugin is a ``vllm.general_plugins`` entry point, so
vllm serve loads it too). Naming each module by its job hash makes ``model`` equal on both sides;
what differs by design is ``system_fingerprint``: Loopline's is the version, ``<job hash>@<step>``
(checked on its own), vLLM's its config hash. Every case of parity_cases.py, asking the adapter,
must then get the same answer from both (test_vllm_parity.py says how answers are compared).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import httpx
import pytest
import scalarlm
from e2e.parity_cases import CASES, MODEL, Case, for_model
from e2e.test_adapter_serving import PAIRS, announce, wait_for
from e2e.test_vllm_parity import MAX_INFLIGHT, OURS, VLLM_ARGS, assert_same, send

from loopline.common.contracts.adapter_format import FROZEN_BASE_TYPES
from loopline.inference.adapters_vllm import to_vllm_lora
from loopline.inference.vllm_args import serve_flags
from loopline.ml.train.checkpoint import latest_checkpoint
from support.stacks import make_stack
from support.vllm_serve import vllm_serve

pytestmark = pytest.mark.timeout(900)

# Every adapter kind vLLM serves (a full fine-tune is a model of its own).
KINDS = FROZEN_BASE_TYPES
# Short: parity needs an adapter that changes the answers, not one that has learnt them.
RECIPE = {"max_steps": 10, "learning_rate": 1e-2, "batch_size": 3, "gradient_accumulation_steps": 1,
          "steps_per_checkpoint": 10}
# Loopline stamps the adapter version it served here (see the module doc).
OURS_HERE = OURS | {"system_fingerprint"}
# The unknown model case names no adapter: test_vllm_parity.py covers it.
ADAPTER_CASES = [case for case in CASES if case.id != "err-unknown-model"]


def flags(tiny: str) -> list[str]:
    return serve_flags(tiny, served_name=MODEL, max_inflight=MAX_INFLIGHT, adapters=True, extra=VLLM_ARGS)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def adapter_stack(tmp_path_factory, tiny):
    stack = make_stack(tmp_path_factory.mktemp("parity-adapter-stack"), tiny, LOOPLINE_LAUNCHER="local",
                       LOOPLINE_RECONCILE_INTERVAL_S="0.25", LOOPLINE_SERVED_MODEL_NAME=MODEL,
                       LOOPLINE_VLLM_ARGS=VLLM_ARGS, LOOPLINE_MAX_INFLIGHT=str(MAX_INFLIGHT))
    stack.start()
    yield stack
    stack.stop()


def completed(llm: scalarlm.SupermassiveIntelligence, job: str) -> bool:
    return llm.get_training_job(job)["job_status"]["status"] == "COMPLETED"


def deployed(http: httpx.Client, job: str) -> bool:
    return http.get(f"/v1/megatron/train/{job}").json()["deployed"]


@pytest.fixture(scope="module")
def trained(adapter_stack, tmp_path_factory, monkeypatch_module) -> dict[str, tuple[str, int, Path]]:
    """kind -> (job hash, step, checkpoint folder), each deployed on the stack."""
    # The client ships ./ml from its working directory as user code: run it from an empty one.
    monkeypatch_module.chdir(tmp_path_factory.mktemp("client"))
    llm = scalarlm.SupermassiveIntelligence(api_url=adapter_stack.url)
    data = [{"input": q, "output": a} for q, a in PAIRS]
    jobs = {kind: llm.train(data, model_name=MODEL, train_args={**RECIPE, "adapter_type": kind})
            ["job_status"]["model_name"] for kind in KINDS}
    out = {}
    with httpx.Client(base_url=adapter_stack.url, timeout=60) as http:
        # Invariant: every kind before this one is trained, announced and deployed.
        for kind, job in jobs.items():
            wait_for(partial(completed, llm, job), 300, 0.5)
            step, checkpoint = latest_checkpoint(adapter_stack.jobs_dir / job)
            announce(adapter_stack, checkpoint, job, MODEL)
            wait_for(partial(deployed, http, job), 60)
            out[kind] = (job, step, checkpoint)
    return out


@pytest.fixture(scope="module")
def clients(tmp_path_factory, tiny, adapter_stack, trained):
    folder = tmp_path_factory.mktemp("vllm-adapters")
    modules = [f"{job}={to_vllm_lora(checkpoint, folder / job)[0]}"
               for job, _, checkpoint in trained.values()]
    log = folder / "vllm-serve.log"
    with (vllm_serve([*flags(tiny), "--lora-modules", *modules], log_path=log) as vllm_url,
          httpx.Client(base_url=vllm_url, timeout=120) as vllm,
          httpx.Client(base_url=adapter_stack.url, timeout=120) as loopline):
        yield loopline, vllm


def test_replica_runs_the_same_flags(tiny, adapter_stack, monkeypatch):
    """vllm serve gets the replica's flags, and only --lora-modules besides."""
    from loopline.common.config.settings import InferenceSettings
    from loopline.inference.service import flags_of

    for key, value in adapter_stack.env().items():
        monkeypatch.setenv(key, value)
    assert flags_of(InferenceSettings(), tiny) == flags(tiny)


@pytest.mark.parametrize("kind", KINDS)
def test_loopline_stamps_the_version(clients, trained, kind: str):
    loopline, _ = clients
    job, step, _ = trained[kind]
    reply = loopline.post("/v1/completions", json={"model": job, "prompt": PAIRS[0][0], "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == job and reply.json()["system_fingerprint"] == f"{job}@{step}"


PARAMS = [pytest.param(kind, case, stream, id=f"{kind}-{case.id}{'-stream' if stream else ''}")
          for kind in KINDS for case in ADAPTER_CASES for stream in (False, True)
          if stream is False or case.stream]


@pytest.mark.parametrize(("kind", "case", "stream"), PARAMS)
def test_same_answer_as_vllm_serve(clients, trained, kind: str, case: Case, stream: bool):
    loopline, vllm = clients
    asked = for_model(case, trained[kind][0])
    theirs = send(vllm, asked, stream=stream)
    assert_same(asked, stream, send(loopline, asked, stream=stream), theirs, OURS_HERE)


@pytest.mark.parametrize("kind", KINDS)
def test_the_adapter_changes_the_answer(clients, trained, kind: str):
    """Else the comparison below would only repeat the base model's."""
    _, vllm = clients
    prompt = {"prompt": PAIRS[0][0], "max_tokens": 8, "temperature": 0}
    base = vllm.post("/v1/completions", json={"model": MODEL, **prompt}).json()["choices"][0]["text"]
    adapted = vllm.post("/v1/completions", json={"model": trained[kind][0], **prompt}).json()
    assert adapted["choices"][0]["text"] != base
