"""One inference replica: load the engine, announce the deployment, run the worker until told to stop."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import signal
import socket
from pathlib import Path

from nats.micro import add_service

from loopline.common import bus, subjects
from loopline.common.schemas import DeploymentInfo, ServiceStatus
from loopline.common.settings import InferenceSettings
from loopline.common.telemetry import setup_tracing
from loopline.inference.adapters import AdapterManager
from loopline.inference.engine import build_engine
from loopline.inference.prompts import PromptBuilder
from loopline.inference.worker import Worker

log = logging.getLogger(__name__)


def resolve_model_path(settings: InferenceSettings) -> str:
    if Path(settings.model).is_dir():
        return settings.model
    from loopline.ml.models.resolve import resolve_model

    return str(resolve_model(settings.model, settings.models_dir))


async def main(settings: InferenceSettings) -> None:
    setup_tracing("loopline-inference", settings.otlp_endpoint)
    replica = settings.replica_id or f"{socket.gethostname()}-{os.getpid()}"
    model_path = await asyncio.to_thread(resolve_model_path, settings)
    engine = build_engine(settings.engine, model_path, max_model_len=settings.max_model_len,
                         max_inflight=settings.max_inflight, dtype=settings.dtype,
                         adapters=settings.adapters, max_adapters=settings.max_adapters,
                         max_adapter_rank=settings.max_adapter_rank)
    log.info("loading %s from %s", settings.name, model_path)
    await engine.start()
    from transformers import AutoTokenizer

    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, model_path)
    prompts = PromptBuilder(tokenizer, engine.info.max_model_len)

    nc = await bus.connect(settings.nats_url, f"inference-{replica}")
    js = nc.jetstream()
    await bus.ensure_topology(js)
    deployment = subjects.deployment_key(settings.name)
    # The consumer must exist before the deployment is announced: the gateway publishes work as
    # soon as it sees the announcement, and WORK keeps only what some consumer is interested in.
    await bus.ensure_work_consumer(js, deployment, ack_wait_s=settings.ack_wait_s,
                                   max_deliver=settings.max_deliver)
    info = DeploymentInfo(model=settings.name, deployment=deployment,
                          max_model_len=engine.info.max_model_len, engine=engine.info.name)
    kv = await js.key_value(subjects.MODELS_BUCKET)
    await kv.put(deployment, info.model_dump_json().encode())

    adapters = None
    if settings.adapters:
        # Before the worker pulls work: a request naming a job finds the catch-up under way.
        folder = settings.state_dir / "adapters" / re.sub(r"[^A-Za-z0-9_.-]", "-", replica)
        adapters = AdapterManager(js, engine, base_model=settings.name, replica=replica,
                                  root=folder.resolve(), max_jobs=settings.max_adapters)
        await adapters.start()
    worker = Worker(nc, js, engine, prompts, deployment=deployment, replica=replica,
                    max_inflight=settings.max_inflight, ack_wait_s=settings.ack_wait_s,
                    max_deliver=settings.max_deliver, adapters=adapters)

    async def status(req) -> None:
        reply = ServiceStatus(service="inference", replica=replica, detail={
            "model": settings.name, "engine": engine.info.name, "in_flight": len(worker.inflight),
            "served": worker.served, "max_model_len": engine.info.max_model_len,
            "adapters": adapters.loaded() if adapters else {},
        })
        await req.respond(reply.model_dump_json().encode())

    svc = await add_service(nc, name=subjects.INFERENCE_SERVICE, version="0.1.0",
                            metadata={"replica": replica, "model": settings.name,
                                      "engine": engine.info.name, "deployment": deployment})
    await svc.add_endpoint(name="status", subject=subjects.SVC_INFERENCE_STATUS, handler=status)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # torch, transformers and vLLM leave a large heap of objects that live as long as the process;
    # without this every full collection walks them all, a pause of tens of milliseconds in the
    # middle of someone's request (the latency pass of bench/serving.py showed them at p90).
    gc.collect()
    gc.freeze()
    log.info("replica %s serving %s (%s engine, max_model_len %d)", replica, settings.name,
             engine.info.name, engine.info.max_model_len)
    run = asyncio.create_task(worker.run())
    await stop.wait()
    log.info("stopping: finishing in-flight requests")
    await worker.drain(timeout_s=10)
    run.cancel()
    if adapters is not None:
        await adapters.stop()
    await svc.stop()
    await nc.drain()
    await engine.stop()
