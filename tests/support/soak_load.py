"""The soak's mixed load: OpenAI completions and chat (streaming and not) through the ``openai``
client, ScalarLM batches through their REST routes, and now and then a small training job through
the ``scalarlm`` client, each counted in a ``Tally``.

Every driver behaves as a patient client does through faults: a refused connection, a 429 or a 5xx
is retried (the same request: a ScalarLM batch and a training job are idempotent by content) until
``answer_deadline_s``; only what is still unanswered then is a breach (``gave_up``). A 4xx other than
429 is the platform rejecting a well-formed request: counted as ``rejected``, also a breach.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import nats
import openai

from loopline.common.contracts import subjects

RETRY_PAUSE_S = 0.5
FINISHED_JOB = {"COMPLETED", "FAILED", "CANCELLED"}
# A few steps on the tiny model: seconds of CPU, checkpoints on the way, so the watcher announces.
TRAIN_ARGS = {"max_steps": 6, "learning_rate": 1e-2, "batch_size": 2, "gradient_accumulation_steps": 1,
              "steps_per_checkpoint": 3}


@dataclass
class Tally:
    """One kind of request: how many were started, answered, retried, and how the others ended."""

    started: int = 0
    answered: int = 0
    retries: int = 0  # attempts after a failed one (a fault's visible cost)
    gave_up: int = 0  # unanswered at the deadline: breach
    rejected: int = 0  # a 4xx other than 429: breach
    duplicates: int = 0  # answers stored more than once (ScalarLM): breach
    failed_jobs: int = 0  # training jobs that ended other than COMPLETED: breach
    errors: Counter = field(default_factory=Counter)  # what the retried attempts met

    def as_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in self.__dict__.items() if k != "errors"},
                "errors": dict(self.errors.most_common(8))}


def status_of(error: BaseException) -> int | None:
    """The HTTP status a client library's error carries (openai's, tinker's, httpx's), if any."""
    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code
    status = getattr(error, "status_code", None)
    return status if isinstance(status, int) else None


def retryable(error: BaseException) -> bool:
    """What a client waits out: the gateway away or restarting, a full queue, a 5xx, a Tinker future
    failed by a worker that went away."""
    status = status_of(error)
    if status is not None:
        return status == 429 or status >= 500
    if type(error).__module__.startswith("tinker") and type(error).__name__ in (
            "APIConnectionError", "APITimeoutError", "RequestFailedError"):
        return True
    return isinstance(error, (openai.APIConnectionError, httpx.TransportError, aiohttp.ClientError,
                              ConnectionError, TimeoutError, IncompleteStream, ModelNotListed,
                              TrainingCallFailed))


class IncompleteStream(Exception):
    """A stream that ended without a finish reason: its gateway went away mid-answer."""


class ModelNotListed(Exception):
    """/v1/models without the served model: its only replica is away (listed again once back)."""


class TrainingCallFailed(Exception):
    """The ``scalarlm`` client's train call failed: it raises a bare Exception with the body for any
    status, so a 503 cannot be told from a 4xx; retried, and a lasting 4xx ends as ``gave_up``."""


async def quiet(error: Exception) -> None:
    """nats-py's error callback: the soak restarts nats-server, and the default one prints each
    refused reconnection's traceback; the client reconnects by itself."""


class Load:
    """The drivers; ``stop`` ends the starting of new requests, not the ones in flight."""

    def __init__(self, url: str, nats_url: str, model: str, *, run_id: str, answer_deadline_s: float,
                 max_tokens: int = 16):
        self.url = url
        self.nats_url = nats_url
        self.model = model
        self.run_id = run_id
        self.answer_deadline_s = answer_deadline_s
        self.max_tokens = max_tokens
        self.tallies = {kind: Tally() for kind in
                        ("completion", "completion_stream", "chat", "chat_stream", "models", "scalarlm",
                         "training", "tinker")}
        self.stop = asyncio.Event()
        self.counter = itertools.count()

    async def patiently(self, tally: Tally, attempt) -> Any:
        """``attempt()`` until it answers or the deadline passes; None when it never did."""
        deadline = time.monotonic() + self.answer_deadline_s
        tally.started += 1
        # Invariant: every earlier attempt failed with a retryable error, before the deadline.
        while True:
            try:
                answer = await attempt()
                tally.answered += 1
                return answer
            except Exception as error:  # sorted below: retried, counted as rejected, or raised
                if not retryable(error):
                    if status_of(error) is not None:
                        tally.rejected += 1
                        tally.errors[f"rejected {error}"[:120]] += 1
                        return None
                    raise
                tally.errors[type(error).__name__] += 1
            if time.monotonic() > deadline:
                tally.gave_up += 1
                return None
            tally.retries += 1
            await asyncio.sleep(RETRY_PAUSE_S)

    # --- OpenAI -----------------------------------------------------------------------------------
    async def openai_client(self, pause_s: float) -> None:
        """One client's loop: the four OpenAI request kinds in turn, ``pause_s`` apart, and the model
        list between rounds (as clients that look up what they may name do)."""
        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="soak", max_retries=0, timeout=120)
        kinds = itertools.cycle(("completion", "completion_stream", "chat", "chat_stream", "models"))
        try:
            # Invariant: every request started by this loop has been answered or counted as given up.
            while not self.stop.is_set():
                kind = next(kinds)
                n = next(self.counter)
                prompt = f"Soak {self.run_id} request {n}: the weather today is"
                await self.patiently(self.tallies[kind],
                                     lambda k=kind, p=prompt: self.one_openai(client, k, p))
                await asyncio.sleep(pause_s)
        finally:
            await client.close()

    async def one_openai(self, client: openai.AsyncOpenAI, kind: str, prompt: str) -> str:
        if kind == "models":
            listed = [m.id async for m in client.models.list()]
            if self.model not in listed:
                raise ModelNotListed(f"/v1/models lists {listed}, not {self.model}")
            return ",".join(listed)
        common = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0}
        messages = [{"role": "user", "content": prompt}]
        if kind == "completion":
            return (await client.completions.create(prompt=prompt, **common)).choices[0].text
        if kind == "chat":
            reply = await client.chat.completions.create(messages=messages, **common)
            return reply.choices[0].message.content or ""
        if kind == "completion_stream":
            stream = await client.completions.create(prompt=prompt, stream=True, **common)
        else:
            stream = await client.chat.completions.create(messages=messages, stream=True, **common)
        text, finished = [], False
        # Invariant: text holds every piece received so far; finished once a choice said why it stopped.
        async for chunk in stream:
            for choice in chunk.choices:
                piece = choice.text if kind == "completion_stream" else choice.delta.content
                text.append(piece or "")
                finished = finished or choice.finish_reason is not None
        if not finished:
            raise IncompleteStream(kind)
        return "".join(text)

    # --- ScalarLM batches -------------------------------------------------------------------------
    async def scalarlm_client(self, batch_size: int, pause_s: float) -> None:
        """Batches of ``batch_size`` new prompts, each polled until every prompt has its answer."""
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as http:
            nc = await nats.connect(self.nats_url, max_reconnect_attempts=-1, error_cb=quiet)
            try:
                # Invariant: every batch submitted by this loop has been fully answered or given up.
                while not self.stop.is_set():
                    n = next(self.counter)
                    prompts = [f"Soak {self.run_id} batch {n} prompt {i}:" for i in range(batch_size)]
                    await self.patiently(self.tallies["scalarlm"],
                                         lambda p=prompts: self.one_batch(http, nc, p))
                    await asyncio.sleep(pause_s)
            finally:
                await nc.close()

    async def one_batch(self, http: httpx.AsyncClient, nc, prompts: list[str]) -> list[str]:
        """Submit (again, after a failure: the same prompts are the same batch) and poll until done.
        A batch counts as one request in the tally: ``answered`` means every prompt was."""
        resp = await http.post("/v1/generate", json={"prompts": prompts, "max_tokens": self.max_tokens})
        resp.raise_for_status()
        ids = [r["request_id"] for r in resp.json()["results"]]
        # Invariant: every earlier poll found some prompt unanswered (or failed and is retried whole).
        while True:
            poll = await http.post("/v1/generate/get_results", json={"request_ids": ids})
            poll.raise_for_status()
            results = poll.json()["results"]
            if all(r["response"] is not None or r["error"] for r in results):
                break
            await asyncio.sleep(RETRY_PAUSE_S)
        errors = [r["error"] for r in results if r["error"]]
        if errors:
            raise httpx.HTTPStatusError(f"answered with an error: {errors[0]}", request=poll.request,
                                        response=httpx.Response(422, request=poll.request))
        await self.count_duplicates(nc, ids)
        return [r["response"] for r in results]

    async def count_duplicates(self, nc, ids: list[str]) -> None:
        """Each prompt's answer is stored once in RESULTS (nothing answered twice)."""
        group = ids[0].rsplit("_", 1)[0]
        info = await nc.jetstream().stream_info(subjects.RESULTS_STREAM,
                                                subjects_filter=subjects.results_of_group(group))
        self.tallies["scalarlm"].duplicates += sum(c - 1 for c in (info.state.subjects or {}).values())

    # --- training ---------------------------------------------------------------------------------
    async def trainer_client(self, train_model: str, every_s: float) -> None:
        """A small job every ``every_s``, followed until it ends; needs a working directory without
        an ``ml/`` folder (the client would ship it as user code)."""
        from masint.api.async_supermassive_intelligence import AsyncSupermassiveIntelligence

        llm = AsyncSupermassiveIntelligence(api_url=self.url)
        # Invariant: every job submitted by this loop has ended (or was given up on).
        while not self.stop.is_set():
            n = next(self.counter)
            data = [{"input": f"Soak {self.run_id} job {n} question {i}?", "output": f" Answer {i}."}
                    for i in range(4)]
            status = await self.patiently(self.tallies["training"],
                                          lambda d=data: self.one_job(llm, train_model, d))
            if status is not None and status != "COMPLETED":
                self.tallies["training"].failed_jobs += 1
            try:
                async with asyncio.timeout(every_s):
                    await self.stop.wait()
            except TimeoutError:
                pass

    async def one_job(self, llm, train_model: str, data: list[dict]) -> str:
        try:
            reply = await llm.train(data, model_name=train_model, train_args=dict(TRAIN_ARGS))
        except aiohttp.ClientError:
            raise
        except Exception as error:  # the client's bare Exception, see TrainingCallFailed
            raise TrainingCallFailed(str(error)[:100]) from error
        if "job_status" not in reply:
            raise TrainingCallFailed(f"train answered {str(reply)[:100]}")
        job_hash = reply["job_status"]["model_name"]
        # Invariant: every earlier look found the job unfinished (or failed and is retried whole).
        while True:
            job = await llm.get_training_job(job_hash)
            status = (job.get("job_status") or {}).get("status")
            if status is None:
                raise TrainingCallFailed(f"get_training_job answered {str(job)[:100]}")
            if status in FINISHED_JOB:
                return status
            await asyncio.sleep(1.0)

    # --- Tinker -----------------------------------------------------------------------------------
    async def tinker_client(self, base_model: str, every_s: float) -> None:
        """One LoRA training session through the unmodified ``tinker`` SDK (its calls block: run in
        a thread), a forward_backward + optim_step on 16 token ids every ``every_s``. Each step is
        one request in the tally; a retried step may apply its gradients twice, which is not judged."""
        import tinker
        from tinker import types

        service = tinker.ServiceClient(base_url=self.url, api_key="tml-loopline-soak")

        def open_session():
            created = service.create_lora_training_client(base_model=base_model, rank=4)
            # tinker 0.38 answers a future of the client (using it as the client is deprecated).
            return created.result() if hasattr(created, "result") else created

        session = await self.patiently(self.tallies["tinker"], lambda: asyncio.to_thread(open_session))
        if session is None:
            return
        tokens = [3 + (7 * i) % 200 for i in range(17)]
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 16})

        def step() -> None:
            session.forward_backward([datum], "cross_entropy").result()
            session.optim_step(types.AdamParams(learning_rate=1e-3)).result()

        # Invariant: every step started by this loop has been answered or given up.
        while not self.stop.is_set():
            await self.patiently(self.tallies["tinker"], lambda: asyncio.to_thread(step))
            try:
                async with asyncio.timeout(every_s):
                    await self.stop.wait()
            except TimeoutError:
                pass
