"""Which training jobs are servable: the gateway's view of ``events.adapters.<hash>.<kind>``.

Inference replicas announce each adapter version they load (``loaded``) or cannot serve
(``rejected``; the checkpoint-watcher sends those too). The gateway follows these events from the
start of the EVENTS stream, so a gateway started later knows every job loaded before it. A job is
*deployed* once any replica has loaded a checkpoint of it; a replica that has not (it started later,
or its LRU bound evicted the job) loads it at the job's next request, so the flag stays true.

A deleted job is ``retired`` (adapter_retire.py): it leaves ``served`` (so /v1/models and
``latest``), a request naming it is answered 404 "deleted" (through ``rejected``), and a ``loaded``
event of a checkpoint written before the retirement, heard late, does not bring it back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from loopline.common.contracts import subjects
from loopline.common.contracts.job_hash import is_job_hash
from loopline.common.contracts.job_schemas import AdapterEvent

log = logging.getLogger(__name__)

# Idle heartbeat of the event subscription: how soon a lost consumer is noticed (start()).
HEARTBEAT_S = 1.0


@dataclass
class ServedAdapter:
    job_hash: str
    base_model: str
    step: int  # the newest step some replica loaded
    adapter_type: str | None
    first_loaded_at: float  # orders jobs for ``latest``
    replicas: set[str] = field(default_factory=set)


class AdapterRegistry:
    def __init__(self, js: JetStreamContext):
        self.js = js
        self.served: dict[str, ServedAdapter] = {}
        # job -> why its newest checkpoint cannot be served (cleared when a later one loads).
        self.rejected: dict[str, str] = {}
        # job -> when it was retired (deleted): loads of checkpoints written before then are ignored.
        self.retired: dict[str, float] = {}
        self._sub: JetStreamContext.PushSubscription | None = None

    async def start(self) -> None:
        # The ordered consumer is ephemeral: a restarted nats-server has lost it, and nats-py
        # re-creates it (from the next sequence) once two idle heartbeats are missed. At the 5 s
        # default a job loaded after a restart stayed out of /v1/models and ``latest`` for about
        # 18 s (tests/gateway/test_adapter_registry.py); at 1 s, a few seconds, for one small
        # message a second while idle.
        self._sub = await self.js.subscribe(
            subjects.ADAPTER_EVENTS_ALL, stream=subjects.EVENTS_STREAM, cb=self._on_event,
            ordered_consumer=True, deliver_policy=DeliverPolicy.ALL, idle_heartbeat=HEARTBEAT_S)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection is closing anyway
                pass

    def deployed(self, job_hash: str) -> bool:
        return job_hash in self.served

    def deployment_error(self, job_hash: str) -> str | None:
        """Why the job's newest checkpoint is not served: the reason of its rejection by a replica
        (or by the checkpoint-watcher), kept until a later checkpoint loads. With ``deployed``
        false, no replica serves the job at all; with it true, an older checkpoint still answers."""
        return self.rejected.get(job_hash)

    def latest(self, base_models: set[str]) -> ServedAdapter | None:
        """The job first loaded most recently, among those adapting a model being served."""
        candidates = [a for a in self.served.values() if a.base_model in base_models]
        return max(candidates, key=lambda a: a.first_loaded_at, default=None)

    async def find(self, job_hash: str) -> ServedAdapter | None:
        """The job's adapter; on a miss, its last ``loaded`` event is read from the stream, so a
        request that follows a load closely does not depend on the subscription's delivery."""
        # Only a job hash is looked up: any other model name would make a subject of its own (a
        # wildcard, a dot) and cannot be a job anyway.
        if job_hash in self.served or not is_job_hash(job_hash):
            return self.served.get(job_hash)
        try:
            msg = await self.js.get_last_msg(subjects.EVENTS_STREAM,
                                             subjects.adapter_event(job_hash, "loaded"))
        except NotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - NATS restarting: as good as not found, for now
            log.debug("looking up adapter %s failed: %s", job_hash, exc)
            return None
        self.apply(AdapterEvent.model_validate_json(msg.data or b""))
        return self.served.get(job_hash)

    async def _on_event(self, msg) -> None:
        try:
            self.apply(AdapterEvent.model_validate_json(msg.data))
        except ValueError:
            log.warning("ignoring a malformed adapter event on %s", msg.subject)

    def apply(self, event: AdapterEvent) -> None:
        if event.kind == "retired":
            self.served.pop(event.job_hash, None)
            self.retired[event.job_hash] = max(event.time, self.retired.get(event.job_hash, event.time))
            self.rejected[event.job_hash] = "the job was deleted"
            return
        if event.kind == "rejected":
            served = self.served.get(event.job_hash)
            if served is None or (event.step or 0) >= served.step:
                self.rejected[event.job_hash] = event.reason or "rejected"
            return
        if event.kind != "loaded" or event.base_model is None or event.step is None:
            return
        written = event.checkpoint_created_at
        if written is None and event.latency_s is not None:  # a replica older than that field
            written = event.time - event.latency_s
        if written is not None and written <= self.retired.get(event.job_hash, float("-inf")):
            return  # a checkpoint of the deleted job, heard after its retirement
        served = self.served.get(event.job_hash)
        if served is None:
            served = self.served[event.job_hash] = ServedAdapter(
                event.job_hash, event.base_model, event.step, event.adapter_type, event.time)
        served.step = max(served.step, event.step)
        if event.replica:
            served.replicas.add(event.replica)
        self.rejected.pop(event.job_hash, None)
