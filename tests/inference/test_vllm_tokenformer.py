"""Tokenformer adapters in vLLM: several per batch, beside a LoRA and the base model, with the
logits of the reference implementation in ``ml/`` (fp32, max abs difference <= 1e-4).

The adapters are made with the ml package (random tensors, non-zero V and lora_B so they change
the logits) and written with the trainer's own checkpoint writer; the reference is transformers +
``apply_adapter``. vLLM runs in fp32 with ``logprobs_mode="raw_logits"``, so its "logprobs" are
the raw logits, for every prompt position (``prompt_logprobs=-1``) and every generated one.
"""

from __future__ import annotations

import asyncio
import json
import math
from importlib.metadata import entry_points
from importlib.util import find_spec
from types import SimpleNamespace

import pytest
import pytest_asyncio
import torch

from loopline.common.contracts.adapter_format import CONFIG_FILE
from support.greedy import greedy_completions
from support.stacks import tiny_model

# Tier: a real vLLM engine per module, 10-20 s to start.
pytestmark = pytest.mark.slow

# The server is started once for the module, so its tests share the module's event loop.
on_module_loop = pytest.mark.asyncio(loop_scope="module")
needs_vllm = pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed")

TOL = 1e-4
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# B: n = 8 (padded to max_lora_rank 32 in vLLM) and only some projections, so the merged qkv_proj
# and gate_up_proj layers hold a Tokenformer slice beside an empty one.
ADAPTERS = {
    "tokenformer-a": {"kind": "tokenformer", "seed": 11,
                      "tokenformer": {"num_tokens": 32, "target_modules": ALL_TARGETS}},
    "tokenformer-b": {"kind": "tokenformer", "seed": 12,
                      "tokenformer": {"num_tokens": 8,
                                      "target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"]}},
    "lora": {"kind": "lora", "seed": 13},
}
LORA = {"r": 8, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
PROMPTS = {"tokenformer-a": "The quick brown fox", "tokenformer-b": "What is the capital of France?",
           "lora": "1 2 3 4", "base": "Hello there, friend"}
GENERATED = 3


# --- adapters and the reference ---------------------------------------------------------------


def make_checkpoint(root, tiny: str, name: str, kind: str, seed: int, tokenformer=None, lora=None):
    """A checkpoint as the trainer writes it (prepare_model, adapter_config, save_checkpoint), with
    random V / lora_B instead of training, so the adapter visibly changes the logits."""
    from transformers import AutoModelForCausalLM

    from loopline.ml.adapters import io as adapter_io
    from loopline.ml.train.checkpoint import save_checkpoint

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    model, fields = adapter_io.prepare_model(model, kind, tokenformer=tokenformer or {}, lora=lora or LORA,
                                             base_model=tiny, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".tokenformer_v") or ".lora_B." in pname:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    config = adapter_io.adapter_config(model, kind, base_model=tiny,
                                       extra={**fields, "job_hash": f"test-{name}"})
    return save_checkpoint(root / name, 1, config, adapter_io.adapter_tensors(model, kind),
                           {"format_version": 1}, keep=1)


def reference_logits(tiny: str, checkpoint, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from loopline.ml.adapters import apply_adapter

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    if checkpoint is not None:
        # Unmerged LoRA computes W x + B A x, as vLLM does; Tokenformer is the ml reference itself.
        model = apply_adapter(model, checkpoint, merge_lora=False)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_checkpoint(root, tiny, name, **spec) for name, spec in ADAPTERS.items()}


@pytest.fixture(scope="module")
def vllm_folders(tmp_path_factory, checkpoints):
    from loopline.inference.adapters_vllm import to_vllm_lora

    root = tmp_path_factory.mktemp("vllm-adapters")
    return {name: to_vllm_lora(ck, root / name) for name, ck in checkpoints.items()}


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny):
    """vLLM's OpenAI server in-process, as a replica runs it, with the flags these tests need."""
    from loopline.inference.vllm_args import serve_flags
    from loopline.inference.vllm_server import VllmServer

    extra = [
        # 3 slots for 3 adapters (the last slot is occupied too: see the -1 note in
        # tokenformer_vllm), 4 cached, so the fifth adapter evicts one.
        "--max-cpu-loras", "4",
        # vLLM's "logprobs" are then the raw logits, for any number of tokens.
        "--max-logprobs", "-1", "--logprobs-mode", "raw_logits",
        # No --lora-target-modules: lm_head is wrapped for LoRA too, as in a replica, so the
        # prompt logprobs below go through vLLM's LoRA logits path (lora_logits_vllm).
    ]
    flags = serve_flags(tiny, served_name="tiny", max_inflight=8, dtype="float32", max_model_len=256,
                        adapters=True, max_adapters=3, max_adapter_rank=32, extra=" ".join(extra))
    server = VllmServer(flags)
    await server.start()
    yield server
    await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lora_requests(server, checkpoints):
    """Loaded at run time into the running server, as the replica's adapter manager loads them
    (converted, added to vLLM, registered under their names)."""
    from loopline.ml.adapters import read_adapter_config

    requests = {name: await server.load_adapter(name, ck, read_adapter_config(ck))
                for name, ck in checkpoints.items()}
    assert [r.lora_int_id for r in requests.values()] == [1, 2, 3]  # the ids the tests below name
    return {**requests, "base": None}


# --- no engine --------------------------------------------------------------------------------


def test_plugin_is_registered_for_every_vllm_process():
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("loopline_tokenformer") == "loopline.inference.tokenformer_vllm:register"


def test_conversion_is_lora_shaped_with_theta_scale_folded(checkpoints, vllm_folders):
    from loopline.ml.adapters import read_adapter_config
    from loopline.ml.adapters.io import read_tensors

    path, kind = vllm_folders["tokenformer-b"]
    assert kind == "tokenformer"
    config, tensors = read_adapter_config(path), read_tensors(path)
    source = read_tensors(checkpoints["tokenformer-b"])
    assert config["r"] == config["lora_alpha"] == config["num_tokens"] == 8  # vLLM's scaling: 1
    assert config["adapter_type"] == "tokenformer" and config["init_lora_weights"] == "loopline-tokenformer"
    module = "model.layers.1.self_attn.q_proj"
    k, v = source[f"{module}.tokenformer_k"], source[f"{module}.tokenformer_v"]
    assert torch.equal(tensors[f"base_model.model.{module}.lora_A.weight"], k)
    assert torch.allclose(tensors[f"base_model.model.{module}.lora_B.weight"], math.sqrt(8) * v.t())
    assert len(tensors) == len(source)
    assert vllm_folders["lora"][1] == "lora"


def test_full_finetunes_are_refused(tmp_path):
    from loopline.inference.adapters_vllm import to_vllm_lora

    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / CONFIG_FILE).write_text('{"adapter_type": "none", "format_version": 1}')
    with pytest.raises(ValueError, match="full fine-tune"):
        to_vllm_lora(tmp_path / "ck", tmp_path / "out")


@needs_vllm
def test_without_the_plugin_vllm_refuses_a_converted_tokenformer(vllm_folders):
    """The guard: a vLLM that lacks the plugin must not serve a Tokenformer as a plain LoRA."""
    from vllm.lora.peft_helper import PEFTHelper

    from loopline.inference import tokenformer_vllm

    tokenformer_vllm.install()
    helper = PEFTHelper.from_local_dir(vllm_folders["tokenformer-a"][0], None)
    vanilla = PEFTHelper._init_is_supported.__loopline_original__
    assert not vanilla(helper) and helper._init_is_supported()
    assert vanilla(PEFTHelper.from_local_dir(vllm_folders["lora"][0], None))


@needs_vllm
def test_theta_between_shrink_and_expand_per_slot_and_slice():
    """The punica wrapper alone: 3 slots (Tokenformer n=16, LoRA, Tokenformer n=4) padded to rank
    16, a merged layer of 3 slices, tokens of every slot and of the base model in one batch."""
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from loopline.inference import tokenformer_vllm as tv
    from loopline.ml.adapters import tokenformer_delta

    gen = torch.Generator().manual_seed(0)
    d_in, slices, max_rank, ranks = 12, (10, 6, 6), 16, (16, 8, 4)
    slot_ids, tf_ids = [7, 8, 9], {7, 9}
    wrapper = PunicaWrapperCPU(64, 8, "cpu")
    manager = SimpleNamespace(punica_wrapper_mapping={"language_model": wrapper}, lora_index_to_id=slot_ids)
    tv._after_init_punica_wrapper(manager, None)
    manager._ll_tokenformer_ids = tf_ids

    a = [torch.zeros(3, 1, max_rank, d_in) for _ in slices]
    b = [torch.zeros(3, 1, out, max_rank) for out in slices]
    weights = {}  # (slot, slice) -> (A [r, d_in], B [d_out, r]) as stored
    for slot, r in enumerate(ranks):
        for i, out in enumerate(slices):
            if slot == 2 and i == 1:
                continue  # an adapter that does not target this slice: zeros
            a_w = torch.randn(r, d_in, generator=gen) / math.sqrt(d_in)
            b_w = torch.randn(out, r, generator=gen) * 0.5
            a[i][slot, 0, :r], b[i][slot, 0, :, :r] = a_w, b_w
            weights[slot, i] = (a_w, b_w)

    token_ids = [7, 7, 8, 0, 9, 9, 0, 8, 7]
    mapping = LoRAMapping(token_ids, token_ids, is_prefill=True)
    wrapper.update_metadata(mapping, slot_ids, 4, 1024)
    tv._after_set_adapter_mapping(manager, None, mapping)

    x = torch.randn(len(token_ids), d_in, generator=gen)
    y = torch.zeros(len(token_ids), sum(slices))
    wrapper.add_lora_linear(y, x, tuple(a), tuple(b), 1.0, slices)

    expected = torch.zeros_like(y)
    for t, lora_id in enumerate(token_ids):
        if lora_id == 0:
            continue  # base model: no delta, although slot -1 is vLLM's index for the last slot
        slot = slot_ids.index(lora_id)
        offset = 0
        for i, out in enumerate(slices):
            if (slot, i) in weights:
                a_w, b_w = weights[slot, i]
                if lora_id in tf_ids:
                    n = ranks[slot]  # the converter stores B = √n Vᵀ
                    v = b_w.t() / math.sqrt(n)
                    expected[t, offset:offset + out] = tokenformer_delta(x[t:t + 1], a_w, v)[0]
                else:
                    expected[t, offset:offset + out] = x[t] @ a_w.t() @ b_w.t()
            offset += out
    assert (y - expected).abs().max().item() < 1e-5

    # The layout the GPU wrapper and the fully sharded layers hand to add_expand: one
    # [slices, tokens, rank] tensor, shrunk separately (after their all-gather / all-reduce).
    buffer = torch.zeros(len(slices), len(token_ids), max_rank)
    wrapper.add_shrink(buffer, x, tuple(a), 1.0)
    y3 = torch.zeros_like(y)
    wrapper.add_expand(y3, buffer, tuple(b), slices, offset_start=0, add_inputs=True)
    assert (y3 - expected).abs().max().item() < 1e-5
    tv.batch_stats(reset=True)


# --- one vLLM engine --------------------------------------------------------------------------


async def _final(llm, ids, params, request_id, lora_request):
    from vllm.inputs import TokensPrompt

    final = None
    async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), params, request_id,
                                  lora_request=lora_request):
        final = out
    return final


def _rows(entries, vocab: int) -> torch.Tensor:
    return torch.tensor([[entry[token].logprob for token in range(vocab)] for entry in entries])


async def _one_batch(llm, requests: dict, prompts: dict, tag: str, params: dict | None = None) -> dict:
    """Raw logits of every prompt and generated position (or what ``params[name]`` asks), all
    requests started in one batch.

    The scheduler is held while the requests arrive, so they start in one forward (and then decode
    together) rather than in whatever steps they happen to reach the engine process.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    every = SamplingParams(max_tokens=GENERATED, temperature=0.0, prompt_logprobs=-1, logprobs=-1,
                           output_kind=RequestOutputKind.FINAL_ONLY)
    params = params or {}
    tasks = {}
    await llm.pause_generation(mode="keep", clear_cache=False)
    for name, lr in requests.items():
        params_of = params.get(name, every)
        tasks[name] = asyncio.create_task(_final(llm, prompts[name], params_of, f"{tag}-{name}", lr))
    for _ in range(500):
        if llm.output_processor.get_num_unfinished_requests() == len(tasks):
            break
        await asyncio.sleep(0.01)
    await llm.resume_generation()
    return dict(zip(tasks, await asyncio.wait_for(asyncio.gather(*tasks.values()), 300), strict=True))


def _max_diffs(outputs: dict, prompts: dict, checkpoint_of: dict, tiny: str, vocab: int) -> dict:
    diffs = {}
    for name, out in outputs.items():
        generated = list(out.outputs[0].token_ids)
        assert len(generated) == GENERATED
        got = torch.cat([_rows(out.prompt_logprobs[1:], vocab), _rows(out.outputs[0].logprobs, vocab)])
        full = prompts[name] + generated
        ref = reference_logits(tiny, checkpoint_of[name], full[:-1])
        assert got.shape == ref.shape
        diffs[name] = (got - ref).abs().max().item()
        # Greedy tokens are the reference's argmax at each generated position.
        assert generated == ref[len(prompts[name]) - 1:].argmax(-1).tolist(), name
    return diffs


def _mixed_forwards(stats: dict, ids: set[int]) -> list[dict]:
    """The forwards that ran exactly these adapters together with the base model."""
    return [f for f in stats["mixed_forwards"] if set(f["ids"]) == ids | {0}]


@needs_vllm
@on_module_loop
async def test_mixed_batch_logits_match_reference(server, lora_requests, checkpoints, tokenizer, tiny):
    llm = server.llm
    vocab = llm.vllm_config.model_config.get_vocab_size()
    prompts = {name: tokenizer.encode(text) for name, text in PROMPTS.items()}
    await llm.collective_rpc("loopline_tokenformer_stats", kwargs={"reset": True})
    outputs = await _one_batch(llm, lora_requests, prompts, "logits")

    # Evidence of one batch, from the engine process: forwards that mixed all four.
    stats = (await llm.collective_rpc("loopline_tokenformer_stats"))[0]
    ids = {lr.lora_int_id for lr in lora_requests.values() if lr is not None}
    tf_ids = {lora_requests[n].lora_int_id for n in ("tokenformer-a", "tokenformer-b")}
    mixed = _mixed_forwards(stats, ids)
    assert mixed and all(set(f["tokenformer_ids"]) == tf_ids for f in mixed), stats
    assert stats["max_tokenformers_in_one_forward"] == 2

    diffs = _max_diffs(outputs, prompts, {**checkpoints, "base": None}, tiny, vocab)
    print("max abs logit difference vLLM vs reference:", diffs, f"({len(mixed)} mixed forwards)")
    assert all(d <= TOL for d in diffs.values()), diffs

    # The adapters matter: each one moves its prompt's logits far more than the tolerance.
    for name in ADAPTERS:
        base = reference_logits(tiny, None, prompts[name])
        assert (reference_logits(tiny, checkpoints[name], prompts[name]) - base).abs().max() > 1.0, name


@needs_vllm
@on_module_loop
async def test_slots_change_kind_when_adapters_come_and_go(server, lora_requests, vllm_folders, checkpoints,
                                                           tokenizer, tiny):
    """Two more adapters loaded at run time into the full engine (3 slots, 4 cached). A batch of two
    LoRAs and one Tokenformer then follows one of two Tokenformers and one LoRA: some slot that held
    a Tokenformer now holds a LoRA (and an evicted adapter is read again from its folder). Θ must
    follow the slots."""
    from vllm.lora.request import LoRARequest

    llm = server.llm
    vocab = llm.vllm_config.model_config.get_vocab_size()
    await llm.collective_rpc("loopline_tokenformer_stats", kwargs={"reset": True})
    first = {name: tokenizer.encode(text) for name, text in PROMPTS.items()}
    await _one_batch(llm, lora_requests, first, "slots-before")
    before = (await llm.collective_rpc("loopline_tokenformer_stats"))[0]["mixed_forwards"][-1]["slots"]

    again = {"lora-again": LoRARequest("lora-again", 4, vllm_folders["lora"][0]),
             "tokenformer-b-again": LoRARequest("tokenformer-b-again", 5, vllm_folders["tokenformer-b"][0])}
    for request in again.values():
        await llm.add_lora(request)
    requests = {"lora": lora_requests["lora"], **again, "base": None}
    texts = {"lora": PROMPTS["tokenformer-a"], "lora-again": PROMPTS["lora"],
             "tokenformer-b-again": PROMPTS["base"], "base": PROMPTS["tokenformer-b"]}
    prompts = {name: tokenizer.encode(text) for name, text in texts.items()}
    await llm.collective_rpc("loopline_tokenformer_stats", kwargs={"reset": True})
    outputs = await _one_batch(llm, requests, prompts, "slots")

    stats = (await llm.collective_rpc("loopline_tokenformer_stats"))[0]
    mixed = _mixed_forwards(stats, {3, 4, 5})
    assert mixed and all(f["tokenformer_ids"] == [5] for f in mixed), stats
    after = mixed[-1]["slots"]
    kind = {1: "tokenformer", 2: "tokenformer", 3: "lora", 4: "lora", 5: "tokenformer"}
    assert [kind[i] for i in before].count("tokenformer") == 2, before
    assert any(kind[b] == "tokenformer" and kind[a] == "lora"
               for b, a in zip(before, after, strict=True)), (before, after)
    checkpoint_of = {"lora": checkpoints["lora"], "lora-again": checkpoints["lora"],
                     "tokenformer-b-again": checkpoints["tokenformer-b"], "base": None}
    diffs = _max_diffs(outputs, prompts, checkpoint_of, tiny, vocab)
    print("after slot changes:", diffs)
    assert all(d <= TOL for d in diffs.values()), diffs


@needs_vllm
@on_module_loop
async def test_greedy_generation_matches_transformers(server, lora_requests, checkpoints, tiny):
    """Every adapter (and the base model) at once through vLLM's /v1/completions on the same
    prompt, against transformers with the same checkpoint applied (support/greedy.py), 16 greedy
    tokens each."""
    prompt = PROMPTS["tokenformer-b"]
    expected = {}
    for name in lora_requests:
        [c] = await asyncio.to_thread(greedy_completions, tiny, [prompt], checkpoint=checkpoints.get(name),
                                      max_tokens=16)
        expected[name] = (c.text, len(c.token_ids), c.finish_reason)

    async def no_events(_event: bytes) -> None:
        pass  # the answers are not streamed

    async def complete(lora_request) -> tuple[str, int, str]:
        model = lora_request.lora_name if lora_request is not None else "tiny"
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        answer = await server.call("/v1/completions", json.dumps(body).encode(), no_events)
        assert answer.status == 200, answer.body
        out = json.loads(answer.body)
        assert out["model"] == model
        [choice] = out["choices"]
        return choice["text"], out["usage"]["completion_tokens"], choice["finish_reason"]

    got = await asyncio.gather(*(complete(r) for r in lora_requests.values()))
    assert dict(zip(lora_requests, got, strict=True)) == expected
    # Four different answers to one prompt: each adapter changes what is generated.
    assert len({text for text, _, _ in expected.values()}) == len(expected), expected


@needs_vllm
@on_module_loop
async def test_topk_prompt_logprobs_on_adapters_in_one_batch_then_serving_goes_on(
        server, lora_requests, checkpoints, tmp_path_factory, tokenizer, tiny):
    """Tinker's ``compute_logprobs`` (top-k prompt logprobs, max_tokens 1) on a LoRA that trains
    the unembedding (as Tinker's ``train_unembed`` default does) and on a Tokenformer, in one batch
    beside requests without prompt logprobs. vLLM 0.32 alone took each prompt row's lm_head LoRA
    slot from the batch's per-request indices and its engine died (``einsum(): subscript b has
    size 3 ... previously seen size 22``, issue 24); see lora_logits_vllm. The prompt logprobs
    must be the reference's, and the engine must serve the next request."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind

    from loopline.inference.adapters_vllm import to_vllm_lora

    root = tmp_path_factory.mktemp("unembed")
    unembed_ck = make_checkpoint(root, tiny, "lora-unembed", "lora", 14,
                                 lora={**LORA, "target_modules": ["q_proj", "v_proj", "lm_head"]})
    unembed = LoRARequest("lora-unembed", 6, to_vllm_lora(unembed_ck, root / "vllm")[0])
    await server.llm.add_lora(unembed)
    requests = {"lora-unembed": unembed, "tokenformer-a": lora_requests["tokenformer-a"],
                "lora": lora_requests["lora"], "base": None}
    texts = {"lora-unembed": "The quick brown fox jumps over the lazy dog, and then it runs away",
             "tokenformer-a": "What is the capital of France? It is Paris, of course.",
             "lora": PROMPTS["lora"], "base": PROMPTS["base"]}
    prompts = {name: tokenizer.encode(text) for name, text in texts.items()}
    k = 5
    # As the gateway asks for compute_logprobs: 1 token, top-k prompt logprobs. The other two
    # sample without prompt logprobs, so the batch's sampled rows (4) differ from any prompt's.
    logprobs = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=k, logprobs=0,
                              output_kind=RequestOutputKind.FINAL_ONLY)
    plain = SamplingParams(max_tokens=4, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)
    await server.llm.collective_rpc("loopline_tokenformer_stats", kwargs={"reset": True})
    outputs = await _one_batch(server.llm, requests, prompts, "topk",
                               {"lora-unembed": logprobs, "tokenformer-a": logprobs, "lora": plain,
                                "base": plain})
    stats = (await server.llm.collective_rpc("loopline_tokenformer_stats"))[0]
    assert _mixed_forwards(stats, {6, lora_requests["tokenformer-a"].lora_int_id,
                                   lora_requests["lora"].lora_int_id}), stats

    for name, ck in (("lora-unembed", unembed_ck), ("tokenformer-a", checkpoints["tokenformer-a"])):
        ids = prompts[name]
        entries = outputs[name].prompt_logprobs
        assert entries[0] is None and len(entries) == len(ids)
        ref = reference_logits(tiny, ck, ids)
        for pos in range(1, len(ids)):
            row = entries[pos]
            best = ref[pos - 1].topk(k).indices.tolist()
            assert set(best) <= set(row), (name, pos)  # the top k, plus the prompt's own token
            assert ids[pos] in row
            worst = max(abs(v.logprob - ref[pos - 1, t].item()) for t, v in row.items())
            assert worst <= TOL, (name, pos, worst)
    # The unembedding's LoRA matters: without it these would be the base model's logits.
    base_ref = reference_logits(tiny, None, prompts["lora-unembed"])
    assert (reference_logits(tiny, unembed_ck, prompts["lora-unembed"]) - base_ref).abs().max() > 1.0

    # Serving goes on: a greedy completion on the base model and on an adapter, by name.
    async def no_events(_event: bytes) -> None:
        pass

    for model in ("tiny", "lora"):
        body = {"model": model, "prompt": PROMPTS["tokenformer-b"], "max_tokens": 4, "temperature": 0,
                "prompt_logprobs": k}
        answer = await server.call("/v1/completions", json.dumps(body).encode(), no_events)
        assert answer.status == 200, answer.body
        assert json.loads(answer.body)["usage"]["completion_tokens"] == 4
    assert server.dead is None
