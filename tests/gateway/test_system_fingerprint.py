"""Which checkpoint answered: ``system_fingerprint`` = ``<job>@<step>`` in OpenAI answers and
``adapter_step`` in ScalarLM results; neither for the base model.

The gateway relays vLLM's answers byte for byte, so the stamp is put on by the replica that pinned
the version (loopline.inference.vllm_answers.VersionStamp, which worker.py applies to the JSON body
and to each streamed event before they are published) and read back by the gateway's ScalarLM
results. Both are exercised here directly, on answers written the way vLLM's server writes them:
compact JSON (Starlette's JSONResponse), stream chunks with only the fields set (vLLM's
``model_dump_json(exclude_unset=True)``, which leaves ``system_fingerprint`` out of every chunk but
the terminal one). tests/inference/test_vllm_answers.py covers the stamp's edge cases (text that
looks like the keys); the end-to-end tests (test_adapter_serving, test_adapter_under_load) check
the same on real vLLM answers.
"""

from __future__ import annotations

import json

from loopline.common.contracts.schemas import ResultItem
from loopline.gateway.core.submit import request_id
from loopline.gateway.scalarlm.generate_api import result_entry
from loopline.inference.vllm_answers import VersionStamp

JOB = "ab" * 32
SERVED_AS = f"{JOB}@7"  # the name the replica registered the pinned version under (adapters.py)
VLLM_FINGERPRINT = "vllm-0.32.0-0123abcd"  # vLLM's own: its version and config hash


def vllm_json(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def completion(text: str, fingerprint: str | None = VLLM_FINGERPRINT) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": SERVED_AS,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2},
            "system_fingerprint": fingerprint}


def chat(text: str) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": SERVED_AS,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2},
            "system_fingerprint": VLLM_FINGERPRINT}


def test_json_answers_name_the_version_and_the_model_the_client_asked_for():
    stamp = VersionStamp(SERVED_AS, "latest", f"{JOB}@7")
    for answer in (completion(" hi"), chat("hi"), completion(" hi", fingerprint=None)):
        stamped = json.loads(stamp.apply(vllm_json(answer)))
        assert stamped["system_fingerprint"] == f"{JOB}@7"
        assert stamped["model"] == "latest"
        # Nothing else moved.
        assert {k: v for k, v in stamped.items() if k not in ("model", "system_fingerprint")} == {
            k: v for k, v in answer.items() if k not in ("model", "system_fingerprint")}


def test_stream_chunks_carry_the_client_model_and_the_terminal_one_the_version():
    stamp = VersionStamp(SERVED_AS, JOB, f"{JOB}@3")
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": SERVED_AS}
    events = [
        {**chunk, "choices": [{"index": 0, "text": " hi", "logprobs": None, "finish_reason": None}]},
        {**chunk, "choices": [{"index": 0, "text": " there", "logprobs": None, "finish_reason": "length"}],
         "system_fingerprint": VLLM_FINGERPRINT},
    ]
    raw = [b"data: %s\n\n" % vllm_json(e) for e in events] + [b"data: [DONE]\n\n"]
    stamped = [stamp.apply(e) for e in raw]
    assert stamped[-1] == b"data: [DONE]\n\n"
    objects = [json.loads(e[len(b"data: "):]) for e in stamped[:-1]]
    assert all(o["model"] == JOB for o in objects)
    # vLLM names a fingerprint on the terminal chunk only; where it does, it is the version's.
    assert "system_fingerprint" not in objects[0]
    assert objects[-1]["system_fingerprint"] == f"{JOB}@3"
    # The transcript stamped whole (the stored result) equals the events stamped one by one.
    assert stamp.apply(b"".join(raw)) == b"".join(stamped)


def result(text: str, step: int | None) -> ResultItem:
    return ResultItem(request_id=request_id("g", 0), group="g", index=0, model=JOB,
                      body=vllm_json(completion(text)).decode(), completion_tokens=2, adapter_step=step)


def test_scalarlm_results_carry_the_step_only_for_adapters():
    entry = result_entry("g_000000000", result(" hi", 5))
    assert entry["adapter_step"] == 5 and entry["response"] == " hi" and entry["error"] is None
    assert entry["token_count"] == 2
    assert "adapter_step" not in result_entry("g_000000000", result(" hi", None))
