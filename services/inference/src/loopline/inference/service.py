"""One inference replica: start vLLM's own OpenAI server in-process, announce the deployment, run the
worker until told to stop.

Loops, under the shared runtime (loopline.common.runtime.service):
  worker         WORK (this deployment's consumer) -> vLLM's app -> RESULTS, then ack (worker.py)
  adapter-loads  announced checkpoints -> new adapter versions in vLLM           (adapters.py)
  engine-watch   vLLM's engine dead -> hand the requests back, end the process    (engine_watch.py)
A replica whose worker died serves nothing while it still looks alive, one whose loader died
serves old versions forever, and one whose engine died fails every request: each ends the process
(exit 1, the runtime's policy) and its supervisor starts a new one; the requests it held are
redelivered.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from pathlib import Path
from typing import Any

from loopline.common.config.settings import InferenceSettings
from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import DeploymentInfo
from loopline.common.runtime import bus
from loopline.common.runtime.service import Runtime
from loopline.inference.adapters import AdapterManager
from loopline.inference.engine_watch import watch_engine
from loopline.inference.lora_targets import served_architecture
from loopline.inference.vllm_args import lora_modules, serve_flags
from loopline.inference.vllm_server import VllmServer
from loopline.inference.vllm_version import require_tested_vllm
from loopline.inference.worker import Worker

log = logging.getLogger(__name__)


def prepare_model_folder(settings: InferenceSettings) -> str:
    """The folder the replica loads its model from: ``settings.model`` when it is one, else the
    named model prepared (downloaded, converted) under the models directory."""
    if Path(settings.model).is_dir():
        return settings.model
    from loopline.ml.models.resolve import resolve_model

    return str(resolve_model(settings.model, settings.models_dir))


def flags_of(settings: InferenceSettings, model_path: str, layers: list[str] | None = None) -> list[str]:
    """The ``vllm serve`` flags of this deployment (vllm_args.py), LoRA on ``layers`` only if given."""
    return serve_flags(model_path, served_name=settings.name, max_inflight=settings.max_inflight,
                       dtype=settings.dtype, max_model_len=settings.max_model_len,
                       adapters=settings.adapters, max_adapters=settings.max_adapters,
                       max_adapter_rank=settings.max_adapter_rank, extra=settings.vllm_args,
                       lora_layers=layers)


def full_weights_flags(settings: InferenceSettings, folder: str, served_name: str) -> list[str]:
    """The flags of a full fine-tune's own engine (full_weights.py): this deployment's, on the
    fine-tune's model folder, under its version's name, without LoRA."""
    return serve_flags(folder, served_name=served_name, max_inflight=settings.max_inflight,
                       dtype=settings.dtype, max_model_len=settings.max_model_len, extra=settings.vllm_args)


def _absolute(model_path: str) -> str:
    """A local folder as an absolute path (what a Tinker client on this host may name it by); a
    Hub id as it is."""
    folder = Path(model_path)
    return str(folder.resolve()) if folder.is_dir() else model_path


async def run(rt: Runtime, settings: InferenceSettings) -> None:
    # 0. Refuse, before a model is prepared or an engine built, a vLLM other than the one the
    # Tokenformer patch is tested with (vllm_version.py): the runtime logs why and exits 2.
    log.info("vLLM %s", await asyncio.to_thread(require_tested_vllm))

    # 1. Start vLLM's own OpenAI server in-process (a signal meanwhile cancels the start: the
    # runtime), with the flags `vllm serve` would get.
    model_path = await asyncio.to_thread(prepare_model_folder, settings)
    layers = lora_modules(model_path) if settings.adapters else None
    server = VllmServer(flags_of(settings, model_path, layers),
                        full_weights=functools.partial(full_weights_flags, settings),
                        full_weights_start_timeout_s=settings.full_weights_start_timeout_s)
    rt.on_stop(server.stop)
    log.info("loading %s from %s", settings.name, model_path)
    await server.start()

    # 2. Connect. The consumer must exist before the deployment is announced: the gateway
    # publishes work as soon as it sees the announcement, and WORK keeps only what some consumer
    # is interested in.
    nc, js = await rt.connect()
    deployment = subjects.deployment_key(settings.name)
    await bus.ensure_work_consumer(js, deployment, ack_wait_s=settings.ack_wait_s,
                                   max_deliver=settings.max_deliver)
    assert server.llm is not None  # started above
    architecture, lora_lm_head = served_architecture(server.llm.model_config)
    info = DeploymentInfo(model=settings.name, deployment=deployment, max_model_len=server.max_model_len,
                          engine="vllm", tasks=list(server.tasks), model_path=_absolute(model_path),
                          max_adapter_rank=settings.max_adapter_rank if settings.adapters else None,
                          architecture=architecture, lora_lm_head=lora_lm_head, lora_modules=layers)
    kv = await js.key_value(subjects.MODELS_BUCKET)
    await kv.put(deployment, info.model_dump_json().encode())

    # 3. Catch up on the announced adapters before the worker pulls work: a request naming a job
    # finds the catch-up under way.
    adapters = None
    if settings.adapters:
        folder = settings.state_dir / "adapters" / re.sub(r"[^A-Za-z0-9_.-]", "-", rt.replica)
        adapters = AdapterManager(js, server, base_model=settings.name, replica=rt.replica,
                                  root=folder.resolve(), max_jobs=settings.max_adapters,
                                  max_full_engines=settings.max_full_weight_engines,
                                  full_engine_wait_s=settings.full_weights_queue_timeout_s)
        rt.on_stop(adapters.stop)
        await adapters.start()
    worker = Worker(nc, js, server, deployment=deployment, replica=rt.replica,
                    max_inflight=settings.max_inflight, ack_wait_s=settings.ack_wait_s,
                    max_deliver=settings.max_deliver, adapters=adapters)

    def status() -> dict[str, Any]:
        # A dead engine ends the process within a second (engine_watch.py); until then it says so.
        return {"model": settings.name, "engine": "vllm", "deployment": deployment,
                "engine_state": f"dead: {why}" if (why := server.dead) else "up", "tasks": list(server.tasks),
                "in_flight": len(worker.inflight), "served": worker.served,
                "max_model_len": server.max_model_len, "adapters": adapters.loaded() if adapters else {}}

    # 4. Answer svc.inference.status (the gateway's health check counts the replicas that do).
    await rt.add_service(subjects.INFERENCE_SERVICE, subjects.SVC_INFERENCE_STATUS, status=status,
                         description=f"Loopline inference replica serving {settings.name}",
                         metadata={"model": settings.name, "engine": "vllm", "deployment": deployment})
    log.info("replica %s serving %s (vLLM, tasks %s, max_model_len %d)", rt.replica, settings.name,
             ",".join(server.tasks), server.max_model_len)

    # 5. Serve until told to stop; the requests in flight then get to finish.
    loops = {"worker": worker.run(rt.stopping), "engine-watch": watch_engine(server, worker, rt.stopping)}
    if adapters is not None:
        loops["adapter-loads"] = adapters.run(rt.stopping)
    await rt.serve(loops)
