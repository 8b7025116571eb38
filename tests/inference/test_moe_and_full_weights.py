"""The pieces a family's replica decides without an engine: which layers a mixture of experts on CPU
takes a LoRA on (and the flag that tells vLLM), and the model folder a full fine-tune is served from.
The engines themselves are tests/e2e/test_families.py's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.utils import CONFIG_NAME

from loopline.common.contracts.adapter_format import WEIGHTS_FILE
from loopline.common.contracts.model_support import MOE_CPU_LORA_MODULES
from loopline.inference.full_weights import model_folder
from loopline.inference.vllm_args import lora_modules, mixture_of_experts, serve_flags
from loopline.ml.models.resolve import resolve_model
from support.stacks import MODELS_DIR


@pytest.mark.parametrize(("name", "moe"), [("tiny", False), ("tiny-qwen3", False), ("tiny-qwen3-moe", True)])
def test_a_mixture_of_experts_is_read_from_its_config(name, moe):
    folder = str(resolve_model(name, MODELS_DIR))
    assert mixture_of_experts(folder) is moe
    assert lora_modules(folder, cpu=True) == (list(MOE_CPU_LORA_MODULES) if moe else None)
    assert lora_modules(folder, cpu=False) is None  # on a GPU vLLM runs LoRA beside experts
    assert not mixture_of_experts("Qwen/Qwen3-30B-A3B")  # a Hub id: vLLM reads the model itself


def test_the_flag_names_vllms_packed_layers(tmp_path):
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"num_local_experts": 8}))  # Mixtral's spelling
    layers = lora_modules(str(tmp_path), cpu=True)
    flags = serve_flags(str(tmp_path), served_name="m", max_inflight=4, adapters=True, cpu=True,
                        lora_layers=layers)
    at = flags.index("--lora-target-modules")
    assert flags[at + 1:at + 4] == ["qkv_proj", "o_proj", "lm_head"]
    assert "--lora-target-modules" not in serve_flags(str(tmp_path), served_name="m", max_inflight=4,
                                                      adapters=True, cpu=True)


def test_a_full_fine_tunes_folder_is_the_base_models_but_its_weights(tmp_path):
    base = resolve_model("tiny-qwen3", MODELS_DIR)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    weights = {k: v + 1 for k, v in load_file(base / "model.safetensors").items()}
    save_file(weights, checkpoint / WEIGHTS_FILE)
    folder = model_folder(base, checkpoint, tmp_path / "model")
    names = {p.name for p in folder.iterdir()}
    assert {CONFIG_NAME, "tokenizer.json", "model.safetensors"} <= names
    served = load_file(folder / "model.safetensors")
    assert all(torch.equal(served[k], weights[k]) for k in weights)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)  # what vLLM's loader reads, transformers reads
    assert torch.equal(model.model.norm.weight, weights["model.norm.weight"])


async def test_a_full_fine_tunes_answers_come_through_as_vllms_do(tmp_path):
    """FullWeightsModel.call over HTTP, against a stand-in of the child's server (the real child is
    tests/e2e/test_families.py's): a JSON answer whole, a stream event by event, a client gone
    mid-stream promptly, an engine that does not answer as a 503."""
    import asyncio

    import httpx

    from loopline.inference.full_weights import FullWeightsModel

    async def slow_events():
        for i in range(3):
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0.05 if i < 2 else 60)

    def child(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            return httpx.Response(200, json={"model": "v"})
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=slow_events())
        raise httpx.ConnectError("the engine is gone")

    model = FullWeightsModel("v", [], tmp_path / "log", start_timeout_s=60)
    model.http = httpx.AsyncClient(base_url="http://child", transport=httpx.MockTransport(child))
    events: list[bytes] = []

    async def on_event(event: bytes) -> None:
        events.append(event)

    answer = await model.call("/v1/completions", b"{}", on_event)
    assert (answer.status, answer.body) == (200, b'{"model":"v"}') and not events

    gone = asyncio.Event()
    asyncio.get_running_loop().call_later(1.0, gone.set)
    started = asyncio.get_running_loop().time()
    answer = await model.call("/v1/chat/completions", b"{}", on_event, gone=gone)
    assert asyncio.get_running_loop().time() - started < 5  # not the stream's 60 s
    assert events == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]

    answer = await model.call("/v1/embeddings", b"{}", on_event)
    assert answer.status == 503 and b"not answering" in answer.body
    await model.stop()


def test_a_full_fine_tunes_engine_has_the_deployments_flags_without_lora():
    from loopline.common.config.settings import InferenceSettings
    from loopline.inference.service import flags_of, full_weights_flags

    settings = InferenceSettings(vllm_args="--seed 7", adapters=True)
    flags = full_weights_flags(settings, "/fine-tune", "job@30")
    assert flags[:4] == ["--model", "/fine-tune", "--served-model-name", "job@30"]
    assert "--enable-lora" not in flags and flags[-2:] == ["--seed", "7"]
    deployment = flags_of(settings, "/base")
    assert [f for f in flags if f.startswith("--") and f not in ("--model", "--served-model-name")] == \
        [f for f in deployment if f.startswith("--") and "lora" not in f and f not in (
            "--model", "--served-model-name", "--max-loras")]


async def test_an_engine_slower_than_the_start_timeout_is_refused_and_stopped(tmp_path):
    """The real child, given 1 s (vLLM's import alone takes longer): the load is refused with the
    setting to raise in the message, and the child is gone, not left importing."""
    import os

    from loopline.inference.full_weights import FullWeightsModel
    from loopline.inference.vllm_server import AdapterRejected

    model = FullWeightsModel("v", ["--model", str(tmp_path / "none")], tmp_path / "log", start_timeout_s=1)
    with pytest.raises(AdapterRejected, match=r"in 1 s .*LOOPLINE_FULL_WEIGHTS_START_TIMEOUT_S"):
        await model.start()
    assert model.proc is not None and model.proc.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(model.proc.pid, 0)
