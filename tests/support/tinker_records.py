"""The Tinker API's shared state as its services write it, for tests of what reads it (the gateway's
REST and event routes, the CLI): records through the product's own TinkerStore, session events
published as a session worker publishes them (``events.sessions.<worker>.<kind>`` on EVENTS).
A gateway must have started on this NATS first: it makes the streams and buckets."""

from __future__ import annotations

from collections.abc import Iterable

from nats.aio.client import Client as NATS

from loopline.common.contracts import subjects, tinker_names
from loopline.common.contracts.tinker_schemas import (
    LoraSpec,
    SessionEvent,
    TinkerCheckpoint,
    TinkerModel,
    TinkerSession,
    TinkerWorker,
)
from loopline.common.runtime import bus
from loopline.common.runtime.tinker_store import TinkerStore
from support.bus_view import BusView

BASE = "test-org/base-model"


def session(**fields) -> TinkerSession:
    return TinkerSession(session_id=tinker_names.new_id(), **fields)


def worker(**fields) -> TinkerWorker:
    return TinkerWorker(**{"worker_id": tinker_names.new_id(), "base_model": BASE,
                           "model_path": "/models/base", "state": "ready", **fields})


def model(of: TinkerSession, on: TinkerWorker, seq: int = 0, **fields) -> TinkerModel:
    return TinkerModel(**{"model_id": tinker_names.model_id(of.session_id, seq), "session_id": of.session_id,
                          "base_model": on.base_model, "model_path": on.model_path,
                          "model_name": on.base_model, "lora": LoraSpec(rank=8), "worker_id": on.worker_id,
                          **fields})


def checkpoint(of: TinkerModel, kind: str, name: str, **fields) -> TinkerCheckpoint:
    """A checkpoint record of ``of``: ``kind`` is a tinker path's (weights, sampler_weights)."""
    path = tinker_names.TinkerPath(of.model_id, kind, name)
    return TinkerCheckpoint(**{"model_id": of.model_id, "name": name, "tinker_path": str(path),
                               "checkpoint_type": "training" if kind == "weights" else "sampler",
                               **fields})


class TinkerBus(BusView):
    """Writes what the gateway, the trainer and the session workers would have written."""

    def put(self, *records: TinkerSession | TinkerWorker | TinkerModel | TinkerCheckpoint) -> None:
        async def put_all(nc: NATS) -> None:
            store = TinkerStore(nc.jetstream(), nc.max_payload)
            await store.start()
            for record in records:
                if isinstance(record, TinkerSession):
                    await store.put_session(record)
                elif isinstance(record, TinkerWorker):
                    await store.put_worker(record)
                elif isinstance(record, TinkerModel):
                    await store.put_model(record)
                else:
                    await store.put_checkpoint(record, tinker_names.parse_path(record.tinker_path).kind)

        self.ask(put_all)

    def publish(self, events: Iterable[SessionEvent]) -> list[int]:
        """Publish in order, as a worker does; each event's EVENTS sequence."""
        async def publish_all(nc: NATS) -> list[int]:
            js, seqs = nc.jetstream(), []
            for n, event in enumerate(events):
                ack = await bus.publish_durable(js, subjects.session_event(event.worker_id, event.kind),
                                                event.model_dump_json().encode(),
                                                msg_id=f"{event.worker_id}:{event.kind}:{event.time}:{n}")
                seqs.append(ack.seq)
            return seqs

        return self.ask(publish_all)
