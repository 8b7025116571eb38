"""What the chaos tests (tests/e2e/test_chaos*.py) share for serving: the seeded moment of a kill,
OpenAI clients that retry as a patient user's do, ScalarLM batches and what RESULTS and the ledger
hold of them, a second gateway. Training jobs: support/chaos_jobs.py.

Every look at NATS is from the outside, on a connection of its own: what the platform published,
not what one of its processes believes it published.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sqlite3
import time
from dataclasses import dataclass, field

import httpx
import nats
import openai

from loopline.common.contracts import subjects
from loopline.common.local import launcher
from loopline.common.local.stack import LocalStack
from support.soak_load import IncompleteStream

SEED_VARIABLE = "LOOPLINE_CHAOS_SEED"


def chaos_rng(test_name: str) -> random.Random:
    """A generator for the test's random moments: ``LOOPLINE_CHAOS_SEED`` replays a run, else a new
    seed, printed (pytest shows it beside a failure)."""
    seed = int(os.environ.get(SEED_VARIABLE) or random.SystemRandom().randrange(2**32))
    print(f"{test_name}: {SEED_VARIABLE}={seed}")
    return random.Random(seed)


# --- OpenAI clients --------------------------------------------------------------------------------
KINDS = ("completion", "completion_stream", "chat", "chat_stream")


@dataclass
class Answer:
    """One logical request as its client saw it: every attempt it made, the one answer it kept."""

    kind: str
    started: float
    ended: float = 0.0
    attempts: int = 0  # whole requests the caller made (the openai client's own retries are inside)
    texts: list[str] = field(default_factory=list)  # complete answers received: must be exactly one
    errors: list[str] = field(default_factory=list)  # what the attempts that failed met


async def one_answer(client: openai.AsyncOpenAI, model: str, kind: str, prompt: str, max_tokens: int,
                     deadline_s: float) -> Answer:
    """One logical request. The openai client retries a refused or cut connection and a 429/5xx by
    itself (its ``max_retries``); a stream already under way when its connection is cut cannot be
    retried by it, so it is asked again here, whole, as a chat UI does."""
    answer = Answer(kind, started=time.monotonic())
    give_up = answer.started + deadline_s
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    messages = [{"role": "user", "content": prompt}]
    # Invariant: every earlier attempt failed (retryably) and left no text in answer.texts.
    while not answer.texts and time.monotonic() < give_up:
        answer.attempts += 1
        try:
            if kind == "completion":
                reply = await client.completions.create(prompt=prompt, **common)
                answer.texts.append(reply.choices[0].text)
            elif kind == "chat":
                chat = await client.chat.completions.create(messages=messages, **common)
                answer.texts.append(chat.choices[0].message.content or "")
            else:
                answer.texts.append(await streamed(client, kind, prompt, messages, common))
        except openai.APIStatusError as exc:
            answer.errors.append(f"{exc.status_code}: {str(exc)[:100]}")
            if exc.status_code != 429 and exc.status_code < 500:
                break  # the platform refused a well-formed request: no answer, a failure to report
        except (openai.APIConnectionError, httpx.TransportError, IncompleteStream) as exc:
            answer.errors.append(f"{type(exc).__name__}: {str(exc)[:100]}")
            await asyncio.sleep(0.5)
    answer.ended = time.monotonic()
    return answer


async def streamed(client: openai.AsyncOpenAI, kind: str, prompt: str, messages: list, common: dict) -> str:
    if kind == "completion_stream":
        stream = await client.completions.create(prompt=prompt, stream=True, **common)
    else:
        stream = await client.chat.completions.create(messages=messages, stream=True, **common)
    text, finishes = [], 0
    # Invariant: text holds every piece received so far; finishes counts the choices that ended.
    async for chunk in stream:
        for choice in chunk.choices:
            piece = choice.text if kind == "completion_stream" else choice.delta.content
            text.append(piece or "")
            finishes += choice.finish_reason is not None
    if finishes != 1:
        raise IncompleteStream(f"{kind} ended with {finishes} finish reasons")
    return "".join(text)


async def openai_load(url: str, model: str, stop: asyncio.Event, *, clients_per_kind: int = 1,
                      max_tokens: int = 32, max_retries: int = 8, deadline_s: float = 180) -> list[Answer]:
    """Clients of every kind, each asking one logical request after another until ``stop``; every
    request they started (answered or not)."""
    answers: list[Answer] = []

    async def one_client(kind: str, number: int) -> None:
        # The openai client's backoff (0.5 s doubling to 8 s) spans a gateway restart with 8 retries.
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="chaos", max_retries=max_retries,
                                    timeout=60)
        try:
            # Invariant: every request this client started is in answers, ended.
            while not stop.is_set():
                prompt = f"Chaos {kind} {number} request {len(answers)}: the weather today is"
                answers.append(await one_answer(client, model, kind, prompt, max_tokens, deadline_s))
        finally:
            await client.close()

    await asyncio.gather(*(one_client(kind, n) for kind in KINDS for n in range(clients_per_kind)))
    return answers


# --- ScalarLM batches --------------------------------------------------------------------------------
async def submit_batch(http: httpx.AsyncClient, prompts: list[str], max_tokens: int) -> list[str]:
    resp = await http.post("/v1/generate", json={"prompts": prompts, "max_tokens": max_tokens})
    assert resp.status_code == 200, resp.text
    return [r["request_id"] for r in resp.json()["results"]]


async def results_until_done(url: str, ids: list[str], deadline_s: float) -> list[dict]:
    """Poll get_results at ``url`` as ScalarLM's client does until every prompt has an answer; a
    gateway that is away is asked again."""
    give_up = time.monotonic() + deadline_s
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        # Invariant: every earlier poll failed or found a prompt unanswered.
        while time.monotonic() < give_up:
            with contextlib.suppress(httpx.TransportError):
                resp = await http.post("/v1/generate/get_results", json={"request_ids": ids})
                if resp.status_code == 200:
                    results = resp.json()["results"]
                    if all(r["response"] is not None or r["error"] for r in results):
                        return results
            await asyncio.sleep(0.2)
    raise AssertionError(f"not every prompt of {ids[0]}… answered at {url} in {deadline_s} s")


async def stored_results(nats_url: str, group: str) -> dict[str, int]:
    """How many results the RESULTS stream holds for each request id of a batch."""
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().stream_info(subjects.RESULTS_STREAM,
                                                subjects_filter=subjects.results_of_group(group))
        return dict(info.state.subjects or {})
    finally:
        await nc.close()


def ledger_statuses(stack: LocalStack, since: float) -> dict[str, int]:
    """The queue's ledger (its SQLite database): requests enqueued since ``since`` by status."""
    with contextlib.closing(sqlite3.connect(stack.state_dir / "loopline.db", timeout=30)) as db:
        rows = db.execute("SELECT status, COUNT(*) FROM requests WHERE enqueued_at >= ? GROUP BY status",
                          (since,)).fetchall()
    return dict(rows)


def start_second_gateway(stack: LocalStack) -> tuple[launcher.Proc, str]:
    """Another gateway on the stack's NATS, on a port of its own: a second replica behind a load
    balancer. Stopping it is the caller's."""
    port = launcher.free_port()
    proc = launcher.start_service("gateway", {**stack.gateway_env(), "LOOPLINE_PORT": str(port)},
                                  stack.logs / f"gateway-{port}.log")
    url = f"http://{stack.host}:{port}"
    launcher.wait_gateway_ready(proc, url, timeout_s=120)
    return proc, url


def assert_answered_once(answers: list[Answer]) -> None:
    """Every logical OpenAI request got exactly one complete answer, as its client saw it."""
    assert answers, "no OpenAI request was made"
    unanswered = [a for a in answers if len(a.texts) != 1]
    assert not unanswered, [(a.kind, a.attempts, a.errors[-3:]) for a in unanswered[:5]]
