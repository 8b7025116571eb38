"""The unmodified ``openai`` client against the running gateway."""

from __future__ import annotations

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client, model, prompt, **kw):
    return client.completions.create(model=model, prompt=prompt, **{"max_tokens": 12, "temperature": 0, **kw})


def test_models_lists_the_served_model(client, stack):
    models = client.models.list().data
    assert models[0].id == stack.model
    # The stack is the session's: a job another test deployed on it is listed after the base model,
    # as an adapter of it.
    assert all(getattr(m, "parent", None) == stack.model for m in models[1:]), models


def test_completion_counts_tokens_and_is_deterministic(client, stack, tokenizer):
    first = complete(client, stack.model, "The quick brown fox")
    second = complete(client, stack.model, "The quick brown fox")
    choice = first.choices[0]
    assert first.object == "text_completion" and choice.text
    assert choice.text == second.choices[0].text  # greedy
    assert first.usage.prompt_tokens == len(tokenizer.encode("The quick brown fox"))
    assert 0 < first.usage.completion_tokens <= 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    if choice.finish_reason == "length":
        assert first.usage.completion_tokens == 12


def test_seed_makes_sampling_repeatable(client, stack):
    a = complete(client, stack.model, "Once upon a time", temperature=1.0, seed=7, max_tokens=16)
    b = complete(client, stack.model, "Once upon a time", temperature=1.0, seed=7, max_tokens=16)
    others = {complete(client, stack.model, "Once upon a time", temperature=1.0, seed=s, max_tokens=16)
              .choices[0].text for s in (1, 2, 3)}
    assert a.choices[0].text == b.choices[0].text
    assert len(others | {a.choices[0].text}) > 1  # different seeds sample differently


def test_n_gives_several_choices(client, stack):
    out = complete(client, stack.model, "Hello", n=3, temperature=1.0, seed=1)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert 3 <= out.usage.completion_tokens <= 3 * 12  # counted over every choice


def test_stop_cuts_before_the_stop_string(client, stack):
    full = complete(client, stack.model, "The lazy dog", max_tokens=16).choices[0].text
    stop = full[len(full) // 2:][:3]
    cut = complete(client, stack.model, "The lazy dog", max_tokens=16, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and full.startswith(cut.text)


def test_prompt_list_gives_a_choice_per_prompt(client, stack):
    out = client.completions.create(model=stack.model, prompt=["alpha", "beta"], max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == complete(client, stack.model, "alpha", max_tokens=5).choices[0].text


def test_chat_uses_the_models_chat_template(client, stack, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=10, temperature=0)
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    assert out.usage.prompt_tokens == len(tokenizer.encode(templated, add_special_tokens=False))


def test_streamed_completion_equals_the_unstreamed_one(client, stack):
    plain = complete(client, stack.model, "Streaming test", max_tokens=16).choices[0].text
    chunks = list(client.completions.create(model=stack.model, prompt="Streaming test", max_tokens=16,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_streamed_chat_with_usage(client, stack):
    messages = [{"role": "user", "content": "Say something"}]
    plain = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=stack.model, messages=messages, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_sse_ends_with_done(stack):
    body = {"model": stack.model, "prompt": "x", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
