"""A stand-in for the gateway's training routes, served over real HTTP by uvicorn in a thread.

The thing under test is the CLI, so the stand-in only follows the route contract: canned
TrainResponses, an SSE event stream per job, an NDJSON-in-SSE log stream. What a job does is chosen
by a ``scenario`` train arg: ``complete`` (default), ``fail``, or ``cut`` (the first event stream
ends mid-job, as when the gateway restarts, and the next one replays everything).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import socket
import tarfile
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, File, Form, HTTPException, UploadFile
from fastapi.responses import StreamingResponse
from typer.testing import CliRunner

from loopline.cli.archive import DATASET_NAME
from loopline.cli.main import app as cli_app


def _events(job_hash: str, scenario: str, max_steps: int) -> list[dict]:
    t0 = 1_700_000_000.0
    kinds = [("queued", {"status": "QUEUED"}), ("started", {"status": "TRAINING"})]
    steps = max_steps if scenario != "fail" else 2
    for step in range(1, steps + 1):
        kinds.append(("progress", {"status": "TRAINING", "step": step, "loss": 3.0 / step,
                                   "learning_rate": 3e-3 * (1 - step / (max_steps + 1)),
                                   "tokens_per_s": 1234.5, "epoch": step / max_steps}))
        if step == steps // 2:
            kinds.append(("checkpoint", {"step": step, "checkpoint": {
                "step": step, "path": f"/jobs/{job_hash}/checkpoint_{step}", "created_at": t0 + step}}))
    if scenario == "fail":
        kinds.append(("failed", {"status": "FAILED", "step": steps,
                                 "error": "CUDA out of memory (simulated)"}))
    else:
        kinds.append(("completed", {"status": "COMPLETED", "step": steps}))
    return [{"job_hash": job_hash, "kind": kind, "seq": seq, "time": t0 + seq, "max_steps": max_steps,
             **fields} for seq, (kind, fields) in enumerate(kinds)]


class StandIn:
    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}
        self.uploads: list[tuple[bytes, dict]] = []
        self.event_connections: dict[str, int] = {}

    def add_job(self, params: dict, archive: bytes = b"") -> str:
        job_hash = hashlib.sha256(archive + json.dumps(params, sort_keys=True).encode()).hexdigest()
        if job_hash in self.jobs:
            return job_hash  # same data and params: the existing job, as the real gateway does
        max_steps = int(params.get("max_steps", 10))
        events = _events(job_hash, params.get("scenario", "complete"), max_steps)
        last = events[-1]
        history = [{"step": e["step"], "loss": e["loss"], "epoch": e["epoch"], "time": 0.5 * e["step"]}
                   for e in events if e["kind"] == "progress"]
        self.jobs[job_hash] = {"events": events, "params": params, "created": time.time(), "status": {
            "status": last["status"], "model_name": job_hash, "job_directory": f"/jobs/{job_hash}",
            "job_id": "42", "start_time": 1_700_000_000.0, "step": last["step"], "max_steps": max_steps,
            "history": history, "error": last.get("error")}}
        return job_hash

    def resolve(self, ref: str) -> str:
        if ref == "latest" and self.jobs:
            return max(self.jobs, key=lambda h: self.jobs[h]["created"])
        matches = [h for h in self.jobs if h.startswith(ref)]
        if len(matches) != 1:
            raise HTTPException(404, f"job {ref} not found")
        return matches[0]

    def response(self, job_hash: str, status: str | None = None) -> dict:
        job = self.jobs[job_hash]
        if job["params"].get("scenario") == "cut" and self.event_connections.get(job_hash, 0) < 2:
            status = status or "TRAINING"  # until the stream is reconnected, the job runs on
        job_status = dict(job["status"], **({"status": status} if status else {}))
        return {"job_status": job_status, "deployed": job_status["status"] == "COMPLETED",
                "job_config": {"llm_name": job["params"].get("llm_name", "tiny-llama"),
                               "adapter_type": job["params"].get("adapter_type", "tokenformer"),
                               "max_steps": job_status["max_steps"]}}

    def build(self) -> FastAPI:
        api = FastAPI()

        @api.post("/v1/megatron/train")
        async def train(file: UploadFile = File(...), params: str = Form(...)):
            data, args = await file.read(), json.loads(params)
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
                if DATASET_NAME not in tar.getnames():
                    raise HTTPException(400, f"the archive has no {DATASET_NAME}")
            self.uploads.append((data, args))
            return self.response(self.add_job(args, data), status="QUEUED")

        @api.get("/v1/megatron/train/{job_hash}/events")
        async def events(job_hash: str):
            job_hash = self.resolve(job_hash)
            job = self.jobs[job_hash]
            self.event_connections[job_hash] = n = self.event_connections.get(job_hash, 0) + 1
            cut = job["params"].get("scenario") == "cut" and n == 1

            async def stream():
                yield ": connected\n\n"
                for event in job["events"][:4] if cut else job["events"]:
                    await asyncio.sleep(0.002)
                    yield f"event: {event['kind']}\ndata: {json.dumps(event)}\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        @api.get("/v1/megatron/train/logs/{ref}")
        async def logs(ref: str, starting_line_number: int = 0):
            job_hash = self.resolve(ref)
            history = self.jobs[job_hash]["status"]["history"]
            lines = [f"step {h['step']} loss {h['loss']:.3f}" for h in history]

            async def stream():
                # Bare NDJSON under an event-stream type, as ScalarLM and Loopline's gateway send it.
                for number, line in enumerate(lines):
                    if number >= starting_line_number:
                        yield json.dumps({"line": line, "line_number": number}) + "\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        @api.get("/v1/megatron/train/{ref}")
        async def get_job(ref: str):
            return self.response(self.resolve(ref))

        @api.get("/v1/megatron/list_models")
        async def list_models():
            return {"models": [{"name": h, "deployed": j["status"]["status"] == "COMPLETED",
                                "status": j["status"]["status"], "start_time": j["status"]["start_time"],
                                "step": j["status"]["step"], "max_steps": j["status"]["max_steps"],
                                "train_time": 12.5, "loss": 0.25} for h, j in self.jobs.items()]}

        @api.post("/v1/megatron/{action}/{ref}")
        async def control(action: str, ref: str):
            job_hash = self.resolve(ref)
            if action == "restart" and self.jobs[job_hash]["status"]["status"] == "COMPLETED":
                raise HTTPException(409, "only a FAILED or CANCELLED job can be restarted")
            status = {"cancel": "CANCELLED", "delete": "CANCELLED", "restart": "QUEUED"}[action]
            return self.response(job_hash, status=status)

        return api


@pytest.fixture(scope="session")
def standin():
    state = StandIn()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(state.build(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the stand-in gateway did not start"
        time.sleep(0.02)
    state.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield state
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def cli(standin):
    """Run ``loopline`` in-process against the stand-in: ``cli("jobs")`` → click Result."""
    runner = CliRunner()

    def run(*args: str, url: str | None = None):
        return runner.invoke(cli_app, ["--url", url or standin.url, *args])

    return run


@pytest.fixture
def refused_url() -> str:
    """A local URL where nothing listens: connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"
