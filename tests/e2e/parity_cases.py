"""The requests the parity test sends to both vLLM's own server and Loopline's gateway.

Each case is one route and one JSON body, greedy (temperature 0) or seeded so that both servers
must produce the same tokens, and small (at most 16 new tokens, 56 where a tool call must close)
so the suite runs on two CPU cores. The stop strings and token ids below were read off the tiny
model's greedy answers (its weights are random): "The capital of France is" continues as tokens
683 "ing", 799 "52", 56 "V", 496 " 8", 467 " assistant", 57 "W", 113, 81 "o", ... and the chat
"Hello" is answered "Prompt oneٵundredo= 248...". A case the tiny model stops answering this way
still compares the two servers; it only tests less.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODEL = "tiny"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"

PROMPT = "The capital of France is"
HELLO = [{"role": "user", "content": "Hello"}]
USAGE = {"include_usage": True}
CONTINUOUS_USAGE = {"include_usage": True, "continuous_usage_stats": True}


@dataclass(frozen=True)
class Case:
    id: str
    route: str
    # A str is sent byte for byte: raw JSON text, so an escape such as "\ud800" reaches the servers
    # as written (a dict would be re-encoded by the client first).
    body: dict[str, Any] | str
    # Sent a second time with "stream": true (and these stream_options, where given).
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    def streamed_body(self) -> dict[str, Any]:
        assert isinstance(self.body, dict), f"{self.id}: a raw body is not streamed"
        extra = {"stream_options": self.stream_options} if self.stream_options else {}
        return {**self.body, "stream": True, **extra}


def completion(case_id: str, *, stream: bool = False, stream_options: dict[str, Any] | None = None,
               **fields: Any) -> Case:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}
    return Case(case_id, COMPLETIONS, body, stream, stream_options)


def chat(case_id: str, *, stream: bool = False, stream_options: dict[str, Any] | None = None,
         **fields: Any) -> Case:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 8, "temperature": 0, **fields}
    # A field set to None is left out (e.g. max_tokens, where max_completion_tokens replaces it).
    return Case(case_id, CHAT, {k: v for k, v in body.items() if v is not None}, stream, stream_options)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}
NOW_TOOL = {"type": "function", "function": {
    "name": "now", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER_TOOL, NOW_TOOL]
# With "required" or a named tool vLLM constrains the answer to `<tool_call>{"name": .., "arguments":
# ..}</tool_call>` (hermes); the bias towards "{", "}" and the end of text lets the random model
# close the call, so vLLM parses it into tool_calls (measured: 50 tokens; unbiased it ran on in
# the arguments past 64).
CLOSE_THE_CALL = {"logit_bias": {"93": 30, "95": 40, "2": 50}, "max_tokens": 56}
# Short strings so a constrained answer closes within max_tokens.
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}

CASES: list[Case] = [
    # --- /v1/completions
    completion("cmpl-basic", stream=True, stream_options=USAGE),
    completion("cmpl-continuous-usage", stream=True, stream_options=CONTINUOUS_USAGE),
    completion("cmpl-logprobs", logprobs=3, stream=True),
    completion("cmpl-echo-logprobs", echo=True, logprobs=2, max_tokens=4, stream=True),
    completion("cmpl-prompt-logprobs", prompt_logprobs=2, max_tokens=4),
    completion("cmpl-tokens-as-ids", logprobs=2, return_tokens_as_token_ids=True, stream=True),
    completion("cmpl-return-token-ids", return_token_ids=True, stream=True),
    completion("cmpl-token-id-prompt", prompt=[1, 352, 549, 335], logprobs=1, stream=True),
    completion("cmpl-token-id-prompts", prompt=[[352, 549, 335], [708, 201]], stream=True),
    completion("cmpl-several-prompts", prompt=[PROMPT, "Hello", "1 2 3"], max_tokens=6, stream=True,
               stream_options=USAGE),
    completion("cmpl-stop", stop=[" assistant"], stream=True),
    completion("cmpl-stop-include", stop=" assistant", include_stop_str_in_output=True, stream=True),
    completion("cmpl-stop-token-ids", stop_token_ids=[467], stream=True),
    completion("cmpl-min-tokens", stop_token_ids=[799], min_tokens=4),
    completion("cmpl-ignore-eos", ignore_eos=True, max_tokens=12),
    completion("cmpl-top-k-seeded", temperature=1.0, top_k=5, seed=7, stream=True),
    completion("cmpl-min-p-seeded", temperature=1.0, min_p=0.1, seed=11),
    completion("cmpl-top-p-seeded", temperature=0.8, top_p=0.5, seed=13),
    completion("cmpl-penalties", presence_penalty=1.5, frequency_penalty=1.0, max_tokens=12),
    completion("cmpl-repetition-penalty", repetition_penalty=1.3, max_tokens=12),
    completion("cmpl-logit-bias", logit_bias={"81": 100}, max_tokens=4, logprobs=1),
    completion("cmpl-allowed-tokens", allowed_token_ids=[56, 57, 81, 496], max_tokens=4),
    completion("cmpl-bad-words", bad_words=[" assistant"]),
    completion("cmpl-n-seeded", n=3, temperature=0.9, seed=3, stream=True, stream_options=USAGE),
    completion("cmpl-json-object", response_format={"type": "json_object"}, max_tokens=16),
    completion("cmpl-structured-choice", structured_outputs={"choice": ["yes", "no", "maybe"]}),
    completion("cmpl-structured-regex", structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"}, stream=True),
    completion("cmpl-structured-json", structured_outputs={"json": SCHEMA}, max_tokens=16),
    completion("cmpl-truncate-prompt", truncate_prompt_tokens=3, max_tokens=4),
    completion("cmpl-echo-no-tokens", echo=True, max_tokens=1, logprobs=0),
    # --- /v1/chat/completions
    chat("chat-basic", stream=True, stream_options=USAGE),
    chat("chat-continuous-usage", stream=True, stream_options=CONTINUOUS_USAGE),
    chat("chat-logprobs", logprobs=True, top_logprobs=3, stream=True),
    chat("chat-tokens-as-ids", logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True),
    chat("chat-prompt-logprobs", prompt_logprobs=1, max_tokens=4),
    chat("chat-echo", messages=[*HELLO, {"role": "assistant", "content": "Hi"}], echo=True,
         add_generation_prompt=False, continue_final_message=True, stream=True),
    chat("chat-system-multi-turn", messages=[
        {"role": "system", "content": "Be brief."}, *HELLO,
        {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye"}]),
    chat("chat-max-completion-tokens", max_tokens=None, max_completion_tokens=5),
    chat("chat-stop", stop=["undred"], stream=True),
    chat("chat-stop-include", stop=["undred"], include_stop_str_in_output=True),
    chat("chat-min-tokens-seeded", temperature=1.0, seed=5, min_tokens=6, top_k=8),
    chat("chat-penalties", presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2,
         max_tokens=12),
    chat("chat-logit-bias", logit_bias={"56": 50}, max_tokens=4),
    chat("chat-n-seeded", n=2, temperature=1.0, seed=21, stream=True, stream_options=USAGE),
    chat("chat-json-object", response_format={"type": "json_object"}, max_tokens=16),
    chat("chat-json-schema", response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": SCHEMA, "strict": True}}, max_tokens=16, stream=True),
    chat("chat-structured-choice", structured_outputs={"choice": ["red", "green"]}, stream=True),
    chat("chat-structured-regex", structured_outputs={"regex": "(cat|dog)s?"}),
    chat("chat-tools-none", tools=TOOLS, tool_choice="none"),
    chat("chat-tools-auto", tools=TOOLS, tool_choice="auto", stream=True),
    chat("chat-tools-required", tools=[NOW_TOOL], tool_choice="required", stream=True, **CLOSE_THE_CALL),
    chat("chat-tools-named", tools=TOOLS, stream=True, **CLOSE_THE_CALL,
         tool_choice={"type": "function", "function": {"name": "now"}}),
    chat("chat-tools-named-unfinished", tools=TOOLS, max_tokens=16,
         tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    chat("chat-tool-result", tools=TOOLS, messages=[
        *HELLO, {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]),
    # --- tokenizer routes
    Case("tokenize-prompt", TOKENIZE, {"model": MODEL, "prompt": PROMPT, "return_token_strs": True}),
    Case("tokenize-no-special", TOKENIZE, {"model": MODEL, "prompt": "Hello", "add_special_tokens": False}),
    Case("tokenize-messages", TOKENIZE, {"model": MODEL, "messages": HELLO, "add_generation_prompt": True}),
    Case("detokenize", DETOKENIZE, {"model": MODEL, "tokens": [352, 549, 335, 548, 330]}),
    # vLLM answers an id beyond the vocabulary with an empty text, not an error.
    Case("detokenize-out-of-vocab", DETOKENIZE, {"model": MODEL, "tokens": [10**6]}),
    # --- /v1/responses
    Case("responses-basic", RESPONSES, {"model": MODEL, "input": "Hello", "max_output_tokens": 8,
                                        "temperature": 0}, stream=True),
    Case("responses-instructions", RESPONSES, {
        "model": MODEL, "instructions": "Be brief.", "max_output_tokens": 6, "temperature": 0,
        "input": [{"role": "user", "content": "Hello"}]}),
    # --- bad input: the same 4xx from both
    completion("err-empty-stop", stop=[""]),
    Case("err-lone-surrogate", COMPLETIONS,
         '{"model": "tiny", "prompt": "\\ud800abc", "max_tokens": 4, "temperature": 0}'),
    Case("err-chat-lone-surrogate", CHAT, '{"model": "tiny", "max_tokens": 4, '
         '"messages": [{"role": "user", "content": "x\\udfffy"}]}'),
    completion("err-negative-max-tokens", max_tokens=-1),
    completion("err-max-tokens-over-context", max_tokens=5000),
    completion("err-too-many-logprobs", logprobs=1000),
    chat("err-bad-json-schema", response_format={"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "nonsense"}}}),
    chat("err-unknown-tool-choice", tools=TOOLS, tool_choice="sometimes"),
    chat("err-named-tool-missing", tools=TOOLS,
         tool_choice={"type": "function", "function": {"name": "not_a_tool"}}),
    chat("err-unknown-model", model="no-such-model"),
    completion("err-wrong-type", temperature="hot"),
    Case("err-not-json", COMPLETIONS, '{"model": "tiny", "prompt": '),
]

assert len({case.id for case in CASES}) == len(CASES), "case ids must be unique"


def for_model(case: Case, name: str) -> Case:
    """``case`` asking ``name`` (an adapter) instead of the base model; a case that names another
    model is returned as it is."""
    if isinstance(case.body, str):
        body: dict[str, Any] | str = case.body.replace(f'"model": "{MODEL}"', f'"model": "{name}"')
    elif case.body.get("model") == MODEL:
        body = {**case.body, "model": name}
    else:
        return case
    return Case(case.id, case.route, body, case.stream, case.stream_options)
