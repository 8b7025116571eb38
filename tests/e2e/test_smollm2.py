"""The one real-model test: SmolLM2-135M-Instruct (the default model) answers sensibly."""

from __future__ import annotations

import openai
import pytest

from support.stacks import make_stack

pytestmark = pytest.mark.smollm2


def test_smollm2_knows_the_capital_of_france(tmp_path):
    with make_stack(tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct") as stack:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.chat.completions.create(
            model="HuggingFaceTB/SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20, temperature=0,
        )
        assert "Paris" in out.choices[0].message.content
