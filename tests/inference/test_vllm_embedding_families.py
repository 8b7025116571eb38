"""A real embedding family in vLLM: the tiny Qwen3 served as Qwen3-Embedding is (a decoder run with
``--runner pooling --convert embed``: its last token's hidden state, normalised), base and an
embedding LoRA trained by the training program, against transformers + PEFT on the same checkpoint.

The LoRA comes from the program's own entry (``training_mode: "embedding"``, the trainer's launch),
is loaded as a replica loads it (``VllmServer.load_adapter``: ``to_vllm_lora``, then vLLM's
``add_lora``), and ``/v1/embeddings`` is vLLM's own app, with the flags a deployment with
``LOOPLINE_VLLM_ARGS="--runner pooling --convert embed"`` gets (``serve_flags``).
"""

from __future__ import annotations

import hashlib
import json
from importlib.util import find_spec
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from ml.test_train_embedding import ROWS, train, write_rows

from loopline.common.contracts.job_hash import job_hash
from loopline.common.contracts.job_layout import DATASET_FILE
from loopline.common.contracts.train_params import JobConfig, TrainParams, canonical
from loopline.ml.models.resolve import resolve_model
from support.stacks import MODELS_DIR

# Tier: a real vLLM engine for the module (10-20 s to start) and a training run (a few seconds).
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed")]
on_module_loop = pytest.mark.asyncio(loop_scope="module")

TOL = 1e-4
# What a deployment's LOOPLINE_VLLM_ARGS says to serve a decoder as an embedder (Qwen3-Embedding's
# way): vLLM's pooling runner, converted to "embed" (last-token pooling, then L2 normalisation).
EMBED_ARGS = "--runner pooling --convert embed"
# Measured (seed 0, vLLM 0.32 on CPU): the mean absolute error of the six pairs' cosines to their
# scores falls from 0.388 to 0.005 in 30 steps at 5e-3; 12 steps at 1e-2 suffice here.
RECIPE = {"training_mode": "embedding", "adapter_type": "lora", "max_steps": 12, "learning_rate": 1e-2,
          "batch_size": len(ROWS), "gradient_accumulation_steps": 1}
TEXTS = [row[key] for row in ROWS for key in ("sentence1", "sentence2")]  # pair i: rows 2i and 2i+1
SCORES = torch.tensor([row["score"] for row in ROWS])


@pytest.fixture(scope="module")
def qwen3() -> str:
    return str(resolve_model("tiny-qwen3", MODELS_DIR))


@pytest.fixture(scope="module")
def checkpoint(qwen3, tmp_path_factory) -> Path:
    """The embedding LoRA the training program makes of the six pairs, through its entry."""
    from loopline.ml.train.checkpoint import latest_checkpoint

    job_dir = tmp_path_factory.mktemp("qwen3-embedding-job")
    params = TrainParams.model_validate(RECIPE)
    data = write_rows(job_dir / DATASET_FILE, ROWS).read_bytes()
    JobConfig(job_hash=job_hash(canonical(params), hashlib.sha256(data).hexdigest()), model_path=qwen3,
              params=params).write(job_dir)
    assert train(job_dir) == 0
    latest = latest_checkpoint(job_dir)
    assert latest is not None
    return latest[1]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(qwen3):
    """vLLM's OpenAI server in-process, as a replica of an embedding deployment runs it."""
    from loopline.inference.vllm_args import serve_flags
    from loopline.inference.vllm_server import VllmServer

    flags = serve_flags(qwen3, served_name="tiny-qwen3", max_inflight=8, dtype="float32", max_model_len=256,
                        adapters=True, max_adapters=2, max_adapter_rank=8, extra=EMBED_ARGS)
    server = VllmServer(flags)
    await server.start()
    yield server
    await server.stop()


async def served_vectors(server, model: str) -> torch.Tensor:
    answer = await server.call("/v1/embeddings", json.dumps({"model": model, "input": TEXTS}).encode(),
                               on_event=_no_stream)
    assert answer.status == 200, answer.body[:500]
    return torch.tensor([d["embedding"] for d in json.loads(answer.body)["data"]])


async def _no_stream(event: bytes) -> None:
    raise AssertionError(f"/v1/embeddings does not stream: {event!r}")


def reference_vectors(qwen3: str, checkpoint: Path | None) -> torch.Tensor:
    """The training program's own embedding (loopline.ml.train.embedding) of each text, one at a
    time as vLLM embeds it, on transformers + PEFT's unmerged LoRA (W x + B A x, as vLLM computes)."""
    from transformers import AutoTokenizer

    from loopline.ml.adapters.io import apply_adapter
    from loopline.ml.train.embedding import embed, load_embedding_model, pooling_of

    base = load_embedding_model(qwen3, torch.device("cpu"), torch.float32)
    pooling = pooling_of(base.config)
    assert pooling == "LAST"  # a decoder: what vLLM's --convert embed pools
    model = base if checkpoint is None else apply_adapter(base, checkpoint, merge_lora=False)
    tokenizer = AutoTokenizer.from_pretrained(qwen3)
    with torch.no_grad():
        rows = [embed(model.eval(), ids := torch.tensor([tokenizer.encode(t, add_special_tokens=True)]),
                      torch.ones_like(ids), pooling)[0] for t in TEXTS]
    return torch.stack(rows)


def mean_abs_error(vectors: torch.Tensor) -> float:
    """Of the pairs' cosines (the vectors are normalised: a dot product) to their scores."""
    cosines = (vectors[0::2] * vectors[1::2]).sum(dim=-1)
    return float((cosines - SCORES).abs().mean())


@on_module_loop
async def test_the_deployment_is_an_embedding_one(server):
    """The gateway routes by the tasks vLLM says it supports (DeploymentInfo.tasks): the flags alone
    make the decoder an "embed" deployment, with no generation, so no other setting is needed."""
    print("vLLM tasks:", server.tasks)
    assert "embed" in server.tasks and "generate" not in server.tasks, server.tasks


@on_module_loop
async def test_served_vectors_equal_the_reference_and_the_lora_pulls_cosines_to_scores(
        server, checkpoint, qwen3):
    from loopline.ml.adapters.io import read_adapter_config

    config = read_adapter_config(checkpoint)
    assert config["task_type"] == "FEATURE_EXTRACTION" and config["peft_type"] == "LORA"
    await server.load_adapter("job-hash", checkpoint, config)  # converted as the replica converts it

    base, trained = await served_vectors(server, "tiny-qwen3"), await served_vectors(server, "job-hash")
    base_ref, trained_ref = reference_vectors(qwen3, None), reference_vectors(qwen3, checkpoint)
    diffs = {"base": float((base - base_ref).abs().max()), "lora": float((trained - trained_ref).abs().max())}
    errors = {"base": mean_abs_error(base), "lora": mean_abs_error(trained)}
    print("max abs difference vLLM vs transformers + PEFT:", diffs, "cosine MAE to scores:", errors)
    assert all(d <= TOL for d in diffs.values()), diffs
    assert float((trained - base).abs().max()) > 100 * TOL  # the adapter is applied, not ignored
    assert errors["lora"] < 0.5 * errors["base"], errors
