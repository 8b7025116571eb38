"""Under load: while a client keeps 32 requests in flight against a job's adapter, ten new
checkpoints of that job arrive; every request succeeds, each answer comes from one consistent
version, and versions never go backwards.

The whole platform runs (LocalStack: gateway, NATS, queue, the real checkpoint-watcher watching the
stack's jobs dir, one vLLM replica on the tiny model). Checkpoints are written into
``<jobs_dir>/<job>/checkpoints/step-XXXXXXXX`` exactly as the training program does (temp folder +
rename, next to the job's config.json naming the served base model): nothing here announces them,
the watcher does. Each version forces a different token (support/forced_adapters.py), so its
greedy answer is known in advance and differs from every other version's by a wide margin.

What "consistent" and "never backwards" mean here:
- every answer's text is exactly the answer of the version its ``system_fingerprint`` names, and a
  streamed answer names one version in every chunk that names one (vLLM sets the fingerprint on
  the terminal chunk only, so that is at least the last one);
- for any two requests a and b where a's response was complete before b was sent: step(b) ≥
  step(a). (One replica pins a request's version when it starts and only moves a job forward, so
  this holds across all 32 client sequences, not only within each.)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import pytest
from openai import AsyncOpenAI

from support.forced_adapters import ForcedAdapters, write_checkpoint, write_job_config

IN_FLIGHT = 32
NEW_CHECKPOINTS = 10
MAX_TOKENS = 6
PROMPTS = ["What is 1 + 1?", "Name a colour.", "Say hello.", "Tell me about rivers and mountains."]
# Each new checkpoint is written once the previous one has answered, after this much more load, so
# every version serves a few rounds of requests and some requests overlap two versions.
EXTRA_LOAD_S = 0.3


@dataclass
class Answer:
    sequence: int
    kind: str
    sent: float  # time.monotonic() on the client
    done: float
    text: str = ""
    steps: tuple[int, ...] = ()  # the step named by each chunk naming one (one entry for a JSON answer)
    error: str | None = None


@pytest.fixture(scope="module")
def load_stack(stack):
    """The session's serving stack (conftest.py): a new job's checkpoints change nothing the other
    tests read."""
    return stack


def step_of(fingerprint: str | None, job: str) -> int:
    assert fingerprint is not None and fingerprint.startswith(f"{job}@"), fingerprint
    return int(fingerprint.rsplit("@", 1)[1])


async def ask(client: AsyncOpenAI, job: str, kind: str, prompt: str) -> tuple[str, tuple[int, ...]]:
    """One request of the given kind; returns its text and the step each chunk that names one (or
    the JSON) named."""
    if kind == "completion":
        r = await client.completions.create(model=job, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].text, (step_of(r.system_fingerprint, job),)
    if kind == "chat":
        r = await client.chat.completions.create(model=job, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].message.content, (step_of(r.system_fingerprint, job),)
    text, steps = "", []
    if kind == "completion-stream":
        stream = await client.completions.create(model=job, prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True)
        async for chunk in stream:
            if chunk.system_fingerprint is not None:
                steps.append(step_of(chunk.system_fingerprint, job))
            text += "".join(c.text for c in chunk.choices)
    else:
        stream = await client.chat.completions.create(
            model=job, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
            temperature=0, stream=True)
        async for chunk in stream:
            if chunk.system_fingerprint is not None:
                steps.append(step_of(chunk.system_fingerprint, job))
            text += "".join(c.delta.content or "" for c in chunk.choices)
    assert steps, f"no chunk of the {kind} named its version"
    return text, tuple(steps)


KINDS = ("completion", "completion-stream", "chat", "chat-stream")


async def run_load(stack, tiny) -> tuple[list[Answer], dict[int, str], dict[int, float]]:
    forge = ForcedAdapters(tiny)
    job = uuid.uuid4().hex + uuid.uuid4().hex  # 64 hex characters, like a trainer's job hash
    steps = list(range(1, NEW_CHECKPOINTS + 2))  # step 1 is deployed first; 2..11 arrive under load
    tokens = dict(zip(steps, forge.pick_tokens(len(steps)), strict=True))
    expected = {s: forge.tokenizer.decode([t] * MAX_TOKENS) for s, t in tokens.items()}
    assert len(set(expected.values())) == len(steps)
    write_job_config(stack.jobs_dir, job, tiny)

    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="none", timeout=120, max_retries=0)
    # The job is deployed once its first checkpoint is loaded: before that the gateway answers 404.
    write_checkpoint(stack.jobs_dir, job, steps[0], forge.config, forge.tensors(tokens[steps[0]]))
    deadline = time.monotonic() + 60
    while True:
        try:
            text, got = await ask(client, job, "completion", PROMPTS[0])
            assert got == (steps[0],) and text == expected[steps[0]], (got, text)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)

    answers: list[Answer] = []
    served: dict[int, float] = {}  # step -> when its first answer completed
    written: dict[int, float] = {}
    stop = asyncio.Event()
    newest_seen = asyncio.Condition()

    async def sequence(i: int) -> None:
        kind = KINDS[i % len(KINDS)]
        n = 0
        while not stop.is_set():
            answer = Answer(i, kind, time.monotonic(), 0.0)
            try:
                answer.text, answer.steps = await ask(client, job, kind, PROMPTS[(i + n) % len(PROMPTS)])
            except Exception as exc:  # noqa: BLE001 - recorded, asserted on below
                answer.error = repr(exc)
            answer.done = time.monotonic()
            answers.append(answer)
            n += 1
            if answer.steps:
                async with newest_seen:
                    for s in set(answer.steps):
                        served.setdefault(s, answer.done)
                    newest_seen.notify_all()

    async def trainer() -> None:
        for step in steps[1:]:
            async with newest_seen:  # the previous version has answered (or 30 s went by)
                try:
                    await asyncio.wait_for(newest_seen.wait_for(lambda step=step: step - 1 in served), 30)
                except TimeoutError:
                    pass
            await asyncio.sleep(EXTRA_LOAD_S)
            written[step] = await asyncio.to_thread(
                write_checkpoint, stack.jobs_dir, job, step, forge.config, forge.tensors(tokens[step]))
        async with newest_seen:  # keep the load on until the last version has answered
            try:
                await asyncio.wait_for(newest_seen.wait_for(lambda: steps[-1] in served), 30)
            except TimeoutError:
                pass
        await asyncio.sleep(EXTRA_LOAD_S)
        stop.set()

    started = time.monotonic()
    await asyncio.gather(trainer(), *(sequence(i) for i in range(IN_FLIGHT)))
    print(f"\n{len(answers)} answers in {time.monotonic() - started:.1f} s; step -> answers: "
          f"{ {s: sum(1 for a in answers if a.steps and a.steps[0] == s) for s in steps} }")
    await client.close()
    return answers, expected, served


def test_new_checkpoints_under_load_serve_consistent_forward_versions(load_stack, tiny):
    answers, expected, served = asyncio.run(run_load(load_stack, tiny))
    steps = sorted(expected)

    errors = [a for a in answers if a.error is not None]
    assert not errors, f"{len(errors)} of {len(answers)} failed, e.g. {errors[:3]}"
    for a in answers:
        # One version per answer, every chunk naming one included, and the text is that version's.
        assert len(set(a.steps)) == 1, f"{a.kind} answer mixed versions {a.steps}"
        assert a.text == expected[a.steps[0]], (a.kind, a.steps[0], a.text, expected[a.steps[0]])
    assert {a.kind for a in answers} == set(KINDS)

    # Never backwards: a request sent after an answer of step s completed is served by step >= s.
    by_done = sorted(answers, key=lambda a: a.done)
    newest_done, j = 0, 0
    for b in sorted(answers, key=lambda a: a.sent):
        while j < len(by_done) and by_done[j].done < b.sent:
            newest_done = max(newest_done, by_done[j].steps[0])
            j += 1
        assert b.steps[0] >= newest_done, f"sent after step {newest_done} answered, got {b.steps[0]}"
    # Per client sequence as well (implied by the above; said plainly).
    for i in range(IN_FLIGHT):
        seq = [a.steps[0] for a in sorted(answers, key=lambda a: a.sent) if a.sequence == i]
        assert seq == sorted(seq), (i, seq)

    # Every new checkpoint was served (the writer waits for each, so none is skipped).
    assert set(served) == set(steps), f"served {sorted(served)} of {steps}"
