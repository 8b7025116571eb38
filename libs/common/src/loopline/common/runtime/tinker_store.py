"""The Tinker API's shared state in NATS: the KV records (sessions, models, workers, samplers,
checkpoints), payloads too large for one message, and the futures' results.

Every service that takes part (gateway, trainer, session worker) reads and writes these through
this one class, so a key's spelling and a record's type are decided once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TypeVar

from nats.js import JetStreamContext
from nats.js.errors import InvalidKeyError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from pydantic import BaseModel

from loopline.common.contracts import subjects
from loopline.common.contracts.tinker_names import model_key
from loopline.common.contracts.tinker_schemas import (
    FutureResult,
    Payload,
    TinkerCheckpoint,
    TinkerModel,
    TinkerSampler,
    TinkerSession,
    TinkerWorker,
)
from loopline.common.runtime import bus, objects

log = logging.getLogger(__name__)

Record = TypeVar("Record", bound=BaseModel)

# Room left in a message for the envelope around an inline payload (base64 grows it by a third).
ENVELOPE_BYTES = 64 * 1024


class TinkerStore:
    def __init__(self, js: JetStreamContext, max_payload: int):
        self.js = js
        self.max_inline = max(0, (max_payload - ENVELOPE_BYTES) * 3 // 4)
        self._kv: dict[str, KeyValue] = {}
        self._blobs: ObjectStore | None = None

    async def start(self) -> None:
        for bucket in (subjects.TINKER_SESSIONS_BUCKET, subjects.TINKER_MODELS_BUCKET,
                       subjects.TINKER_WORKERS_BUCKET, subjects.TINKER_SAMPLERS_BUCKET,
                       subjects.TINKER_CHECKPOINTS_BUCKET):
            self._kv[bucket] = await self.js.key_value(bucket)
        self._blobs = await self.js.object_store(subjects.TINKER_BLOBS_BUCKET)

    # --- records ----------------------------------------------------------------------------------
    async def _get(self, bucket: str, key: str, kind: type[Record]) -> Record | None:
        try:
            entry = await self._kv[bucket].get(key)
        except NotFoundError:  # KeyNotFoundError and KeyDeletedError both are
            return None
        except InvalidKeyError:  # a client's id with characters no key of ours has: none such
            return None
        return kind.model_validate_json(entry.value) if entry.value else None

    async def _put(self, bucket: str, key: str, record: BaseModel) -> None:
        await self._kv[bucket].put(key, record.model_dump_json().encode())

    async def _all(self, bucket: str, kind: type[Record], under: str | None = None) -> list[Record]:
        keys = await bus.kv_keys(self.js, bucket, under)
        found = await asyncio.gather(*(self._get(bucket, key, kind) for key in keys))
        return [r for r in found if r is not None]  # deleted keys keep a marker: None

    async def session(self, session_id: str) -> TinkerSession | None:
        return await self._get(subjects.TINKER_SESSIONS_BUCKET, session_id, TinkerSession)

    async def put_session(self, session: TinkerSession) -> None:
        await self._put(subjects.TINKER_SESSIONS_BUCKET, session.session_id, session)

    async def sessions(self) -> list[TinkerSession]:
        return await self._all(subjects.TINKER_SESSIONS_BUCKET, TinkerSession)

    async def model(self, model_id: str) -> TinkerModel | None:
        return await self._get(subjects.TINKER_MODELS_BUCKET, model_key(model_id), TinkerModel)

    async def put_model(self, model: TinkerModel) -> None:
        await self._put(subjects.TINKER_MODELS_BUCKET, model_key(model.model_id), model)

    async def models(self) -> list[TinkerModel]:
        return await self._all(subjects.TINKER_MODELS_BUCKET, TinkerModel)

    async def worker(self, worker_id: str) -> TinkerWorker | None:
        return await self._get(subjects.TINKER_WORKERS_BUCKET, worker_id, TinkerWorker)

    async def put_worker(self, worker: TinkerWorker) -> None:
        await self._put(subjects.TINKER_WORKERS_BUCKET, worker.worker_id, worker)

    async def workers(self) -> list[TinkerWorker]:
        return await self._all(subjects.TINKER_WORKERS_BUCKET, TinkerWorker)

    async def sampler(self, sampling_session_id: str) -> TinkerSampler | None:
        return await self._get(subjects.TINKER_SAMPLERS_BUCKET, sampling_session_id, TinkerSampler)

    async def put_sampler(self, sampler: TinkerSampler) -> None:
        await self._put(subjects.TINKER_SAMPLERS_BUCKET, sampler.sampling_session_id, sampler)

    @staticmethod
    def checkpoint_key(model_id: str, kind: str, name: str) -> str:
        # KV keys allow letters, digits and "-_=." : a name is one of ours (tinker_names.is_name).
        return f"{model_key(model_id)}.{kind}.{name}"

    async def checkpoint(self, model_id: str, kind: str, name: str) -> TinkerCheckpoint | None:
        return await self._get(subjects.TINKER_CHECKPOINTS_BUCKET,
                               self.checkpoint_key(model_id, kind, name), TinkerCheckpoint)

    async def put_checkpoint(self, checkpoint: TinkerCheckpoint, kind: str) -> None:
        key = self.checkpoint_key(checkpoint.model_id, kind, checkpoint.name)
        await self._put(subjects.TINKER_CHECKPOINTS_BUCKET, key, checkpoint)

    async def delete_checkpoint(self, model_id: str, kind: str, name: str) -> None:
        await self._kv[subjects.TINKER_CHECKPOINTS_BUCKET].delete(self.checkpoint_key(model_id, kind, name))

    async def all_checkpoints(self) -> list[TinkerCheckpoint]:
        return await self._all(subjects.TINKER_CHECKPOINTS_BUCKET, TinkerCheckpoint)

    async def checkpoints(self, model_id: str) -> list[TinkerCheckpoint]:
        found = await self._all(subjects.TINKER_CHECKPOINTS_BUCKET, TinkerCheckpoint, model_key(model_id))
        return sorted(found, key=lambda c: c.created_at)

    # --- payloads ---------------------------------------------------------------------------------
    async def pack(self, name: str, data: bytes) -> Payload:
        """``data`` inline when it fits in a message, else stored under ``name`` in the blobs."""
        if len(data) <= self.max_inline:
            return Payload.inline(data)
        assert self._blobs is not None, "start() first"
        await self._blobs.put(name, data)
        return Payload(blob=name, size=len(data))

    async def unpack(self, payload: Payload) -> bytes:
        if payload.blob is None:
            return payload.inline_bytes()
        return await objects.read_bytes(self.js, subjects.TINKER_BLOBS_BUCKET, payload.blob)

    # --- futures ----------------------------------------------------------------------------------
    async def finish(self, result: FutureResult) -> None:
        """Store a future's result; a second result for the same request is dropped (dedupe)."""
        await bus.publish_durable(self.js, subjects.tinker_future(result.request_id),
                                  result.model_dump_json().encode(), msg_id=result.request_id)

    async def result(self, request_id: str) -> FutureResult | None:
        try:
            raw = await self.js.get_last_msg(subjects.TINKER_FUTURES_STREAM,
                                             subjects.tinker_future(request_id), direct=True)
        except NotFoundError:
            return None
        return FutureResult.model_validate_json(raw.data or b"")
