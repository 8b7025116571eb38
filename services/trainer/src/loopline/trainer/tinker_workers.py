"""Tinker session workers: started where training runs, followed until they end.

A session worker is a Slurm job (a local process under the local launcher) that loads one base
model and serves every Tinker training client of that base placed on it. ``place`` puts a new
client's model on the live worker of its base, starting one when there is none, and hands the
worker the model's first call. ``reconcile`` follows the workers' runs: a worker that ended is
released (it exits by itself once its clients have been idle past the TTL) or failed, and the
calls it left unanswered get a clear error, so no client waits on a future nobody will resolve.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import shutil
import sys
import time

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from loopline.common.config.settings import TrainerSettings
from loopline.common.contracts import subjects, tinker_names
from loopline.common.contracts.tinker_schemas import (
    FutureResult,
    PlaceModel,
    SessionEvent,
    StepCall,
    TinkerModel,
    TinkerWorker,
)
from loopline.common.runtime import bus
from loopline.common.runtime.service import pause
from loopline.common.runtime.tinker_store import TinkerStore
from loopline.trainer import jobdir
from loopline.trainer.errors import Unavailable
from loopline.trainer.launchers import Launcher, LauncherError, LaunchSpec, LaunchState

log = logging.getLogger(__name__)

# A worker that has not started within this long (a Slurm queue that never runs it) is failed.
START_TIMEOUT_S = 1800.0
# Expired checkpoints are looked for this often: a TTL is hours or days, the listing is not free.
EXPIRY_INTERVAL_S = 30.0


class SessionWorkers:
    def __init__(self, settings: TrainerSettings, launcher: Launcher, launchers: dict[str, Launcher],
                 nc: NATS, js: JetStreamContext):
        self.settings = settings
        self.launcher, self.launchers = launcher, launchers
        self.js = js
        self.store = TinkerStore(js, nc.max_payload)
        self.jobs_dir = settings.jobs_dir.resolve()
        self._placing = asyncio.Lock()  # two clients of one base must find the same worker

    async def start(self) -> None:
        await self.store.start()

    # --- placing a model --------------------------------------------------------------------------
    async def place(self, request: PlaceModel) -> TinkerModel:
        async with self._placing:
            model = await self.store.model(request.model.model_id)
            if model is None or model.state != "active":  # a retry finds the model placed already
                worker = await self._live_worker(request.model.base_model) or \
                    await self._start_worker(request.model.base_model, request.model.model_path)
                model = request.model.model_copy(update={"worker_id": worker.worker_id})
                await self.store.put_model(model)
        # The same request id as the first time: a retried placement's call is dropped as a duplicate.
        await bus.publish_durable(self.js, subjects.tinker_calls(model.worker_id),
                                  request.first.model_dump_json().encode(), msg_id=request.first.request_id)
        return model

    async def _live_worker(self, base_model: str) -> TinkerWorker | None:
        for worker in await self.store.workers():
            if worker.base_model == base_model and worker.state in ("starting", "ready"):
                return worker
        return None

    async def _start_worker(self, base_model: str, model_path: str) -> TinkerWorker:
        worker = TinkerWorker(worker_id=tinker_names.new_id(), base_model=base_model, model_path=model_path,
                              launcher=self.launcher.name)
        folder = tinker_names.worker_dir(self.jobs_dir, worker.worker_id)
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)  # the worker's alone: no job's code reads it
        settings = self.settings
        # Its NATS credential: in a 0600 file of the trainer's the entrypoint reads, never in the
        # script (jobdir.write_entrypoint), and never in a job's environment (job_env denies it).
        secret = {"LOOPLINE_NATS_URL": settings.tinker_worker_nats_url or settings.nats_url}
        env = {"LOOPLINE_STATE_DIR": str(settings.state_dir.resolve()),
               "LOOPLINE_JOBS_DIR": str(self.jobs_dir), "LOOPLINE_LOG_LEVEL": settings.log_level,
               "LOOPLINE_TINKER_WORKER_ID": worker.worker_id, "LOOPLINE_TINKER_BASE_MODEL": base_model,
               "LOOPLINE_TINKER_MODEL_PATH": model_path,
               "LOOPLINE_TINKER_IDLE_TTL_S": str(settings.tinker_idle_ttl_s),
               "LOOPLINE_TINKER_MAX_REQUEST_BYTES": str(settings.tinker_max_request_bytes),
               "LOOPLINE_TINKER_MAX_CLIENTS": str(settings.tinker_max_clients),
               "LOOPLINE_REPLICA_ID": worker.worker_id[:12],
               "LOOPLINE_METRICS_PORT": "0"}
        if settings.tinker_shared_passes is not None:
            env["LOOPLINE_TINKER_SHARED_PASSES"] = str(settings.tinker_shared_passes).lower()
        program = (shlex.split(settings.tinker_worker_command) if settings.tinker_worker_command
                   else [sys.executable, "-m", "loopline.tinker_worker"])
        await asyncio.to_thread(jobdir.write_entrypoint, folder, program, user_code=False, env=env,
                                secret_env=secret)
        spec = LaunchSpec(worker.worker_id, folder, 1, time_limit_s=int(settings.max_train_time_s))
        # The record first: the worker reads it at start, and a crash after the submit leaves a
        # record the reconcile loop can follow.
        await self.store.put_worker(worker)
        try:
            worker.run_id = await asyncio.to_thread(self.launcher.submit, spec)
        except LauncherError as exc:
            worker.state, worker.error = "failed", f"could not start a session worker: {exc}"
            await self.store.put_worker(worker)
            raise Unavailable(worker.error) from exc
        await self.store.put_worker(worker)
        log.info("session worker %s for %s: %s run %s", worker.worker_id, base_model, self.launcher.name,
                 worker.run_id)
        return worker

    # --- following the workers --------------------------------------------------------------------
    async def reconcile(self) -> None:
        """One pass: every worker not known to have ended is compared with its launcher's view."""
        for worker in await self.store.workers():
            if worker.state not in ("starting", "ready") or worker.run_id is None:
                continue
            launcher = self.launchers.get(worker.launcher)
            if launcher is None:
                continue
            state = await asyncio.to_thread(launcher.state, worker.run_id)
            if state is LaunchState.PENDING and time.time() - worker.started_at > START_TIMEOUT_S:
                await asyncio.to_thread(launcher.cancel, worker.run_id)
                await self._ended(worker, "failed", f"it did not start within {START_TIMEOUT_S:.0f} s")
            elif state.ended:
                latest = await self.store.worker(worker.worker_id) or worker
                if state is LaunchState.DONE:
                    await self._ended(latest, "released", None)
                else:
                    tail = await asyncio.to_thread(jobdir.log_tail, tinker_names.worker_dir(
                        self.jobs_dir, worker.worker_id), 1500)
                    await self._ended(latest, "failed", f"it ended {state.value}"
                                      + (f"; its last output:\n{tail}" if tail else ""))

    async def expire_checkpoints(self) -> int:
        """Forget, and delete the files of, every checkpoint saved with a ``ttl_seconds`` that has
        run out. Replicas keep serving a sampler save they loaded until they unload it."""
        now, expired = time.time(), 0
        for checkpoint in await self.store.all_checkpoints():
            if checkpoint.expires_at is None or checkpoint.expires_at > now:
                continue
            path = tinker_names.parse_path(checkpoint.tinker_path)
            if path.kind == "weights":
                folder = tinker_names.state_dir(self.jobs_dir, path.model_id, path.name)
            else:
                folder = self.jobs_dir / (checkpoint.adapter or "")
            await self.store.delete_checkpoint(path.model_id, path.kind, path.name)
            if folder != self.jobs_dir:
                await asyncio.to_thread(shutil.rmtree, folder, True)
            expired += 1
            log.info("checkpoint %s expired", checkpoint.tinker_path)
        return expired

    async def _ended(self, worker: TinkerWorker, state: str, why: str | None) -> None:
        worker.state = "released" if state == "released" else "failed"
        worker.error = why
        await self.store.put_worker(worker)
        for model in await self.store.models():
            if model.worker_id == worker.worker_id and model.state == "active":
                model.state = "released" if state == "released" else "failed"
                model.error = f"its session worker {why}" if why else "released"
                await self.store.put_model(model)
        failed = await self._fail_calls(worker, why or "it was released")
        log.warning("session worker %s %s%s; %d unanswered calls failed", worker.worker_id, worker.state,
                    f" ({why.splitlines()[0]})" if why else "", failed)
        event = SessionEvent(worker_id=worker.worker_id, kind=worker.state, base_model=worker.base_model,
                             detail=why)
        await bus.publish_durable(self.js, subjects.session_event(worker.worker_id, event.kind),
                                  event.model_dump_json().encode(), msg_id=f"{worker.worker_id}:{event.kind}")

    async def _fail_calls(self, worker: TinkerWorker, why: str) -> int:
        """Answer every call the worker left in TINKER_CALLS with an error, and remove it."""
        subject = subjects.tinker_calls(worker.worker_id)
        try:  # A work-queue stream allows one consumer per subject: the worker's goes first.
            await self.js.delete_consumer(subjects.TINKER_CALLS_STREAM,
                                          subjects.tinker_calls_durable(worker.worker_id))
        except Exception:  # noqa: BLE001 - it never made one, or it is gone already
            pass
        sub = await self.js.pull_subscribe(subject, stream=subjects.TINKER_CALLS_STREAM,
                                           config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT,
                                                                 deliver_policy=DeliverPolicy.ALL))
        failed = 0
        try:
            # Invariant: every call fetched so far has an error result stored, then was acked.
            while True:
                try:
                    msgs = await sub.fetch(64, timeout=0.5)
                except TimeoutError:
                    return failed
                for msg in msgs:
                    call = StepCall.model_validate_json(msg.data)
                    await self.store.finish(FutureResult(
                        request_id=call.request_id, model_id=call.model_id, ok=False, category="user",
                        error=f"the session worker of {call.model_id} stopped before running this call: "
                              f"{why.splitlines()[0]}. Its training state is lost; resume from your last "
                              "save (ServiceClient.create_training_client_from_state)"))
                    await msg.ack_sync()
                    failed += 1
        finally:
            await sub.unsubscribe()


async def tinker_workers_loop(workers: SessionWorkers, stopping: asyncio.Event, interval_s: float) -> None:
    """The trainer's ``tinker-workers`` loop: session workers followed, expired checkpoints removed."""
    # Invariant: every worker whose run ended before the last pass is released or failed, and
    # none of its calls is left without an answer; no checkpoint expired EXPIRY_INTERVAL_S ago.
    expired_at = 0.0
    while not stopping.is_set():
        try:
            await workers.reconcile()
            if time.monotonic() - expired_at >= EXPIRY_INTERVAL_S:
                await workers.expire_checkpoints()
                expired_at = time.monotonic()
        except Exception:  # NATS restarting, a launcher hiccup: the next pass tries again
            log.exception("following the session workers failed; trying again")
        if await pause(stopping, interval_s):
            return
