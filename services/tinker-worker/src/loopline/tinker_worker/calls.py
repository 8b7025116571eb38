"""What each Tinker training call does on a session worker, from the SDK's request to its result.

``Calls.run`` takes one ``StepCall`` and returns the future's result; the compute is the training
clients' (one resident base model, an adapter and optimizer per client), run in a thread so the
worker's heartbeat goes on. A mistake of the caller's (an unknown loss, a missing input, a bad
path) is a ``user`` error, which the SDK fails fast on instead of retrying.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from tinker import types as tt

from loopline.common.config.settings import TinkerWorkerSettings
from loopline.common.contracts import tinker_names
from loopline.common.contracts.job_layout import CHECKPOINTS_DIR, checkpoint_name
from loopline.common.contracts.tinker_schemas import (
    FutureResult,
    Payload,
    SessionEvent,
    StepCall,
    TinkerCheckpoint,
    TinkerModel,
    TinkerSampler,
)
from loopline.common.runtime.tinker_store import TinkerStore
from loopline.tinker_worker import provenance, staleness
from loopline.tinker_worker.proto import (
    RequestBounds,
    decode_forward_backward,
    encode_forward_backward_output,
)
from loopline.tinker_worker.saves import (
    NotAnnounced,
    folder_bytes,
    wait_announced,
    write_sampler_checkpoint,
    write_state,
)
from loopline.tinker_worker.training import PassCall, TrainingClients
from loopline.tinker_worker.types import PassResult, UserError

log = logging.getLogger(__name__)

PROTO = "application/x-protobuf"


class Calls:
    def __init__(self, settings: TinkerWorkerSettings, clients: TrainingClients, store: TinkerStore,
                 nc: NATS, js: JetStreamContext, emit):
        self.settings = settings
        self.clients = clients
        self.store = store
        self.nc, self.js = nc, js
        self.emit = emit  # SessionEvent -> None (published in the background)
        self.jobs_dir = settings.jobs_dir.resolve()
        # model -> the summed loss of its forward_backward calls since its last optim_step
        self._loss: dict[str, float] = {}
        # model -> how stale the samples its forward_backward calls trained since then were
        self._staleness: dict[str, staleness.Tally] = {}
        # request id -> what finishes that call in the background (run by the worker loop)
        self.pending: dict[str, Coroutine[Any, Any, None]] = {}
        self.bounds = RequestBounds(settings.tinker_max_request_bytes, clients.base.max_tokens,
                                    clients.base.vocab_size)

    async def run(self, call: StepCall, model: TinkerModel) -> FutureResult | None:
        """The call's result; None when ``pending`` holds what stores it later (a sampler save
        waits for the checkpoint-watcher, and the calls after it must not wait with it)."""
        try:
            handler = getattr(self, f"_{call.kind}")
            return await handler(call, model)
        except (UserError, ValueError) as exc:
            return _failed(call, str(exc), "user")
        except Exception as exc:  # a bug or a resource error: the SDK may retry the call
            log.exception("%s of %s failed", call.kind, call.model_id)
            return _failed(call, f"{call.kind} failed on the session worker: {type(exc).__name__}: {exc}",
                           "server")

    # --- the calls --------------------------------------------------------------------------------
    async def _create_model(self, call: StepCall, model: TinkerModel) -> FutureResult:
        try:
            await asyncio.to_thread(self.clients.create, model.model_id, model.lora)
        except UserError as exc:
            await self._never_made(model, exc)
            raise
        self.emit(SessionEvent(worker_id=model.worker_id, kind="created", model_id=model.model_id,
                               base_model=model.base_model))
        return _json(call, {"model_id": model.model_id, "type": "create_model"})

    async def forward_backwards(self, calls: list[tuple[StepCall, TinkerModel]]) -> list[FutureResult]:
        """Several models' forward_backward calls, their compute in shared passes
        (``TrainingClients.forward_backward_many``); each call's result is what it would be alone.
        Should the shared passes fail otherwise than by a caller's mistake, each call runs alone,
        so that a failure is the call's own."""
        results: list[FutureResult | None] = [None] * len(calls)
        requests: list[tuple[int, PassCall]] = []
        for k, (call, model) in enumerate(calls):
            try:
                requests.append((k, await self._pass_call(call, model)))
            except (UserError, ValueError) as exc:
                results[k] = _failed(call, str(exc), "user")
        try:
            done = await asyncio.to_thread(self.clients.forward_backward_many, [r for _, r in requests])
        except Exception:
            log.exception("forward_backward of %d models in shared passes failed; running them one by one",
                          len(requests))
            for k, _ in requests:
                results[k] = await self.run(*calls[k])
        else:
            for (k, request), result in zip(requests, done, strict=True):
                call = calls[k][0]
                if isinstance(result, UserError):
                    results[k] = _failed(call, str(result), "user")
                    continue
                try:
                    results[k] = await self._pass_result(call, request, result)
                except Exception as exc:  # storing the result failed: the SDK may retry the call
                    log.exception("forward_backward of %s: storing its result failed", call.model_id)
                    results[k] = _failed(call, f"forward_backward failed on the session worker: "
                                         f"{type(exc).__name__}: {exc}", "server")
        return [r for r in results if r is not None]

    async def _forward_backward(self, call: StepCall, model: TinkerModel) -> FutureResult:
        request = await self._pass_call(call, model)
        result = await asyncio.to_thread(self.clients.forward_backward, request.model_id, request.data,
                                         request.loss_fn, request.loss_fn_config, request.forward_only)
        return await self._pass_result(call, request, result)

    async def _pass_call(self, call: StepCall, model: TinkerModel) -> PassCall:
        assert call.proto is not None, "forward_backward carries its protobuf body"
        # The one decode of this body's data: the gateway read its routing fields and sizes alone.
        request = decode_forward_backward(await self.store.unpack(call.proto), self.bounds)
        if request.loss_fn == "stable_reinforce":  # it trains against what sampling recorded
            records = await provenance.load(self.store.js, provenance.request_ids(request.data))
            request.data = provenance.apply(request.data, records, model)
        return PassCall(model.model_id, request.data, request.loss_fn, request.loss_fn_config,
                        request.forward_only)

    async def _pass_result(self, call: StepCall, request: PassCall, result: PassResult) -> FutureResult:
        if not request.forward_only:
            loss = result.metrics.get("loss:sum", 0.0)
            self._loss[request.model_id] = self._loss.get(request.model_id, 0.0) + loss
            tally = await staleness.of_call(self.js, request.data, request.model_id,
                                            self.clients.step_count(request.model_id))
            self._staleness.setdefault(request.model_id, staleness.Tally()).add(tally)
        proto = encode_forward_backward_output("ArrayRecord", result.outputs, result.metrics)
        payload = await self.store.pack(f"result-{call.request_id}", proto)
        return FutureResult(request_id=call.request_id, model_id=call.model_id, media_type=PROTO,
                            payload=payload)

    async def _optim_step(self, call: StepCall, model: TinkerModel) -> FutureResult:
        body = tt.OptimStepRequest.model_validate_json(call.body)
        params = body.optim_params
        if not isinstance(params, tt.AdamParams):
            raise UserError("only AdamW is supported here (adam_params)")
        metrics = await asyncio.to_thread(self.clients.optim_step, model.model_id, params)
        tally = self._staleness.pop(model.model_id, staleness.Tally())
        metrics.update(tally.metrics())
        self.emit(SessionEvent(worker_id=model.worker_id, kind="step", model_id=model.model_id,
                               base_model=model.base_model, step=self.clients.step_count(model.model_id),
                               loss=self._loss.pop(model.model_id, None), learning_rate=params.learning_rate,
                               staleness=dict(tally.behind) if tally.behind else None,
                               unstamped=tally.unstamped or None))
        return _json(call, {"metrics": metrics, "type": "optim_step"})

    async def _save_weights(self, call: StepCall, model: TinkerModel) -> FutureResult:
        body = tt.SaveWeightsRequest.model_validate_json(call.body)
        name = body.path or tinker_names.state_name(call.seq_id, call.request_id)
        folder = tinker_names.state_dir(self.jobs_dir, model.model_id, name)
        if folder.exists() and not body.overwrite and body.path is not None:
            raise UserError(f"a checkpoint named {name!r} exists already; pass overwrite=True or use "
                            "another name")
        await asyncio.to_thread(write_state, folder, lambda out: self.clients.save_state(model.model_id, out))
        path = str(tinker_names.TinkerPath(model.model_id, "weights", name))
        await self._record(model, "training", name, path, folder, body.ttl_seconds)
        self.emit(SessionEvent(worker_id=model.worker_id, kind="saved", model_id=model.model_id, path=path,
                               step=self.clients.step_count(model.model_id)))
        return _json(call, {"path": path, "type": "save_weights"})

    async def _save_weights_for_sampler(self, call: StepCall, model: TinkerModel) -> None:
        body = tt.SaveWeightsForSamplerRequest.model_validate_json(call.body)
        name = body.path or tinker_names.ephemeral_name(call.seq_id, call.request_id)
        adapter = tinker_names.sampler_hash(model.model_id, name)
        step = self.clients.step_count(model.model_id)
        folder = await asyncio.to_thread(
            write_sampler_checkpoint, self.jobs_dir, adapter, base_model=model.base_model,
            model_path=model.model_path, step=step,
            write=lambda out: self.clients.save_adapter(model.model_id, out, model.model_path))
        path = str(tinker_names.TinkerPath(model.model_id, "sampler_weights", name))
        await self._record(model, "sampler", name, path, folder, body.ttl_seconds, adapter=adapter, step=step)
        sampler = TinkerSampler(sampling_session_id=tinker_names.new_id(), base_model=model.base_model,
                                adapter=adapter, model_path=path, step=step, owner=model.owner,
                                session_id=model.session_id)
        await self.store.put_sampler(sampler)
        self.emit(SessionEvent(worker_id=model.worker_id, kind="saved", model_id=model.model_id, path=path,
                               step=step))
        # The replicas can load it once the checkpoint-watcher has announced it: that wait is the
        # worker loop's to run beside the calls that follow (the trainer is not stalled).
        self.pending[call.request_id] = self._finish_when_announced(call, model, adapter, step, path,
                                                                     sampler.sampling_session_id)
        return None

    async def _finish_when_announced(self, call: StepCall, model: TinkerModel, adapter: str, step: int,
                                     path: str, sampling_session_id: str) -> None:
        started = time.monotonic()
        try:
            await wait_announced(self.nc, self.js, model.base_model, adapter, step,
                                 self.settings.tinker_announce_timeout_s)
        except NotAnnounced as exc:
            await self.store.finish(_failed(call, f"sampler weights {path}: {exc}", "server"))
            return
        log.info("%s announced %.0f ms after it was written", path, (time.monotonic() - started) * 1000)
        await self.store.finish(_json(call, {"path": path, "sampling_session_id": sampling_session_id,
                                             "type": "save_weights_for_sampler"}))

    async def _load_weights(self, call: StepCall, model: TinkerModel) -> FutureResult:
        body = tt.LoadWeightsRequest.model_validate_json(call.body)
        path = tinker_names.parse_path(body.path)
        checkpoint = await self.store.checkpoint(path.model_id, path.kind, path.name)
        if checkpoint is None:
            raise UserError(f"no checkpoint {body.path}")
        if path.kind == "sampler_weights" and body.optimizer:
            raise UserError(f"{body.path} holds sampler weights, without optimizer state: load it with "
                            "optimizer=False, or load a save_state checkpoint")
        folder = Path(_folder_of(checkpoint, self.jobs_dir))
        first = model.model_id not in self.clients.models()
        try:
            await asyncio.to_thread(self.clients.load_state, model.model_id, folder, body.optimizer,
                                    model.lora)
        except UserError as exc:
            if first:
                await self._never_made(model, exc)
            raise
        if first:
            self.emit(SessionEvent(worker_id=model.worker_id, kind="created", model_id=model.model_id,
                                   base_model=model.base_model, path=body.path))
        return _json(call, {"path": body.path, "model_id": model.model_id, "type": "load_weights"})

    async def _never_made(self, model: TinkerModel, exc: UserError) -> None:
        """A client this worker refused to make (it is full, the LoRA does not fit) fails its record,
        so that its later calls are answered at once and it no longer counts as its key's; one it
        holds (a second create of it, with another LoRA) is left as it is."""
        if model.model_id in self.clients.models():
            return
        record = await self.store.model(model.model_id)
        if record is not None and record.state == "active":
            record.state, record.error = "failed", str(exc)
            await self.store.put_model(record)

    async def _unload_model(self, call: StepCall, model: TinkerModel) -> FutureResult:
        self.release(model.model_id)
        return _json(call, {"model_id": model.model_id, "type": "unload_model"})

    def release(self, model_id: str) -> None:
        self.clients.drop(model_id)
        self._loss.pop(model_id, None)
        self._staleness.pop(model_id, None)

    async def _record(self, model: TinkerModel, kind: Any, name: str, path: str, folder: Path,
                      ttl_s: int | None, *, adapter: str | None = None, step: int | None = None) -> None:
        now = time.time()
        checkpoint = TinkerCheckpoint(
            model_id=model.model_id, checkpoint_type=kind, name=name, tinker_path=path, created_at=now,
            size_bytes=await asyncio.to_thread(folder_bytes, folder), adapter=adapter,
            step=self.clients.step_count(model.model_id) if step is None else step,
            expires_at=now + ttl_s if ttl_s else None)
        await self.store.put_checkpoint(checkpoint, "weights" if kind == "training" else "sampler_weights")


def _folder_of(checkpoint: TinkerCheckpoint, jobs_dir: Path) -> Path:
    path = tinker_names.parse_path(checkpoint.tinker_path)
    if path.kind == "weights":
        return tinker_names.state_dir(jobs_dir, path.model_id, path.name)
    assert checkpoint.adapter is not None
    return jobs_dir / checkpoint.adapter / CHECKPOINTS_DIR / checkpoint_name(checkpoint.step)


def _json(call: StepCall, body: dict[str, Any]) -> FutureResult:
    return FutureResult(request_id=call.request_id, model_id=call.model_id,
                        payload=Payload.inline(json.dumps(body).encode()))


def _failed(call: StepCall, error: str, category: Any) -> FutureResult:
    return FutureResult(request_id=call.request_id, model_id=call.model_id, ok=False, error=error,
                        category=category)

