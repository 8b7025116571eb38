"""The unmodified ``scalarlm`` client (``SupermassiveIntelligence``) against the running gateway."""

from __future__ import annotations

import httpx
import pytest
import scalarlm


@pytest.fixture(scope="module")
def llm(stack):
    return scalarlm.SupermassiveIntelligence(api_url=stack.url)


def openai_greedy(stack, prompt: str, max_tokens: int) -> str:
    body = {"model": stack.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]


def test_generate_three_prompts(llm, stack):
    prompts = ["What is 1 + 1?", "Name a colour.", "The quick brown fox"]
    answers = llm.generate(prompts=prompts, max_tokens=8)
    assert len(answers) == 3 and all(isinstance(a, str) and a for a in answers)
    # Same engine, same greedy decoding: the OpenAI route gives the same text, in prompt order.
    assert answers == [openai_greedy(stack, p, 8) for p in prompts]


def test_generate_defaults_to_sixteen_tokens(llm, stack):
    [answer] = llm.generate(prompts=["Count with me"])
    assert answer == openai_greedy(stack, "Count with me", 16)


def test_generate_two_hundred_prompts_uses_upload_and_keeps_order(llm, stack):
    prompts = [f"Prompt number {i}:" for i in range(200)]
    answers = llm.generate(prompts=prompts, max_tokens=4)
    assert len(answers) == 200 and all(isinstance(a, str) for a in answers)
    for i in (0, 7, 123, 199):
        assert answers[i] == openai_greedy(stack, prompts[i], 4)


def test_generate_chat_prompt(llm, stack):
    [answer] = llm.generate(prompts=[{"messages": [{"role": "user", "content": "hi"}]}], max_tokens=6)
    assert isinstance(answer, str)


def test_health_reports_services(llm):
    health = llm.health()
    assert health["api"] == "up" and health["vllm"] == "up" and health["queue"] == "up"
    assert health["services"]["vllm"][0]["engine"] in ("vllm", "reference")


def test_metrics_count_what_was_served(llm):
    llm.generate(prompts=["metrics please"], max_tokens=4)
    metrics = llm.metrics()
    assert metrics["requests"] >= 1 and metrics["tokens"] >= 1
    assert metrics["token/s"] > 0 and "queue_depth" in metrics


def test_resubmitting_an_identical_batch_returns_the_stored_answers(stack):
    body = {"prompts": ["cache me"], "max_tokens": 5}
    first = httpx.post(f"{stack.url}/v1/generate", json=body, timeout=120).json()["results"][0]
    again = httpx.post(f"{stack.url}/v1/generate", json=body, timeout=120).json()["results"][0]
    assert first["request_id"] == again["request_id"] and first["response"] == again["response"]
