"""The gateway's Tinker part: the shared records, which served model a client means, handing a
training call to its model's session worker, and waiting for a future's result.

Nothing here is kept only in memory: sessions, models and samplers are KV records, a call is
durable once TINKER_CALLS has acked it, and a result lives in TINKER_FUTURES, so any gateway can
answer any future.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from loopline.common.contracts import subjects
from loopline.common.contracts.job_schemas import OwnerFilter
from loopline.common.contracts.schemas import DeploymentInfo
from loopline.common.contracts.tinker_schemas import (
    FutureResult,
    Payload,
    StepCall,
    TinkerCheckpoint,
    TinkerModel,
    TinkerSampler,
    TinkerSession,
)
from loopline.common.runtime import bus
from loopline.common.runtime.tinker_store import TinkerStore
from loopline.gateway.auth.tenancy import sees
from loopline.gateway.core.arrivals import Arrivals
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.model_directory import ModelDirectory


def _absolute(name: str) -> str:
    folder = Path(name).expanduser()
    return str(folder.resolve()) if folder.is_dir() else name


class TinkerPart:
    def __init__(self, nc: NATS, js: JetStreamContext, models: ModelDirectory):
        self.nc, self.js = nc, js
        self.models = models
        self.store = TinkerStore(js, nc.max_payload)

    async def start(self) -> None:
        await self.store.start()

    # --- base models ------------------------------------------------------------------------------
    async def base(self, name: str) -> DeploymentInfo:
        """The served model a client names by its served name or by the folder it is loaded from
        (the cookbook sends the name it loads its tokenizer from)."""
        await self.models.refresh()
        served = self.models.served
        if name in served:
            return served[name]
        wanted = await asyncio.to_thread(_absolute, name)
        # A deployment a replica serves now before one only its MODELS entry remembers.
        listed = self.models.listed()
        for info in [*listed, *(i for i in served.values() if i not in listed)]:
            if info.model_path is not None and info.model_path == wanted:
                return info
        known = ", ".join(f"{m} ({i.model_path})" if i.model_path else m for m, i in served.items())
        raise ApiError(404, f"base model {name!r} is not served here; served: {known or 'none yet'}",
                       param="base_model")

    # --- records, as one tenant sees them (auth/tenancy.py): another key's is not there -----------
    async def model(self, model_id: str, tenant: OwnerFilter = None) -> TinkerModel:
        model = await self.store.model(model_id)
        if model is None or not sees(tenant, model.owner):
            raise ApiError(404, f"no training client {model_id!r} on this server", param="model_id")
        return model

    async def checkpoint(self, model_id: str, kind: str, name: str,
                         tenant: OwnerFilter = None) -> TinkerCheckpoint | None:
        """A checkpoint of a training run ``tenant`` may see; None otherwise."""
        if tenant is not None:
            model = await self.store.model(model_id)
            if model is None or not sees(tenant, model.owner):
                return None
        return await self.store.checkpoint(model_id, kind, name)

    async def session(self, session_id: str, tenant: OwnerFilter = None) -> TinkerSession | None:
        session = await self.store.session(session_id)
        return session if session is not None and sees(tenant, session.owner) else None

    async def sampler(self, sampling_session_id: str, tenant: OwnerFilter = None) -> TinkerSampler | None:
        sampler = await self.store.sampler(sampling_session_id)
        return sampler if sampler is not None and sees(tenant, sampler.owner) else None

    # --- calls ------------------------------------------------------------------------------------
    async def submit(self, model: TinkerModel, call: StepCall, proto: bytes | None = None) -> None:
        """Make ``call`` durable on its worker's subject; a model that can no longer train gets its
        future failed at once, with what to do next."""
        if model.state != "active":
            await self.store.finish(FutureResult(
                request_id=call.request_id, model_id=call.model_id, ok=False, category="user",
                error=f"training client {model.model_id} is {model.state}"
                      f"{': ' + model.error if model.error else ''}; create a new one from your last "
                      "saved state (ServiceClient.create_training_client_from_state)"))
            return
        if proto is not None:
            call.proto = await self.store.pack(f"call-{call.request_id}", proto)
        try:
            await bus.publish_durable(self.js, subjects.tinker_calls(model.worker_id),
                                      call.model_dump_json().encode(), msg_id=call.request_id,
                                      deadline_s=30)
        except bus.StreamFull as exc:
            raise ApiError(429, f"the Tinker call queue is full: {exc}; retry later") from exc
        except bus.BusUnavailable as exc:
            raise ApiError(503, f"the message bus did not accept the call: {exc}; retry") from exc

    # --- futures ----------------------------------------------------------------------------------
    async def wait(self, request_id: str, timeout_s: float) -> FutureResult | None:
        """The future's result, waiting up to ``timeout_s`` for it; None if not done by then."""
        arrivals: Arrivals[str, FutureResult] = Arrivals(self.store.result)

        async def on_msg(msg: Msg) -> None:
            arrivals.heard(request_id, FutureResult.model_validate_json(msg.data))

        # Listen first, then look in the store: a result stored between the two is heard.
        sub = await self.nc.subscribe(subjects.tinker_future(request_id), cb=on_msg)
        try:
            return (await arrivals.wait([request_id], timeout_s)).get(request_id)
        finally:
            await sub.unsubscribe()

    async def payload(self, payload: Payload | None) -> bytes:
        return b"" if payload is None else await self.store.unpack(payload)
