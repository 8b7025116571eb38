"""Fixtures for the checkpoint-watcher tests: the watcher as a real process, real job directories
holding real Tokenformer checkpoints of the tiny model (written by the training program's own
code), and a listener that records every announcement and rejected event.

Helpers are handed out through fixtures (test modules cannot import a conftest).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import nats.errors
import pytest

from loopline.common.contracts import subjects
from loopline.common.contracts.job_layout import CHECKPOINTS_DIR, checkpoint_name, checkpoint_temp_prefix
from loopline.common.contracts.job_schemas import AdapterEvent, CheckpointAnnounce
from loopline.common.contracts.train_params import TOKENFORMER_TARGET_MODULES, JobConfig, TrainParams
from loopline.common.local import launcher
from loopline.common.runtime import bus
from loopline.trainer import jobdir
from support.stacks import tiny_model

MODEL = "tiny"  # the served name; the job's llm_name, <base> of the subjects


@pytest.fixture(scope="session")
def adapter():
    """A Tokenformer adapter of the tiny model, made by loopline.ml (8 tokens, every projection),
    V perturbed so the tensors are not zeros: (adapter_config without step, tensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    from loopline.ml.adapters import io as adapter_io

    path = tiny_model()
    model = AutoModelForCausalLM.from_pretrained(path)
    model, fields = adapter_io.prepare_model(
        model, "tokenformer", tokenformer={"num_tokens": 8, "target_modules": TOKENFORMER_TARGET_MODULES},
        lora={}, base_model=path, seed=0)
    tensors = adapter_io.adapter_tensors(model, "tokenformer")
    generator = torch.Generator().manual_seed(1)
    tensors = {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in tensors.items()}
    config = adapter_io.adapter_config(model, "tokenformer", base_model=path, extra=fields)
    return config, tensors


class Jobs:
    """Job directories as the trainer lays them out (its own config writer), and checkpoints as the
    training program writes them (loopline.ml.train.checkpoint.save_checkpoint: temp folder, fsync,
    rename)."""

    def __init__(self, root: Path, adapter):
        self.root = root
        self.config, self.tensors = adapter
        self._staged: dict[Path, int] = {}  # temp folder -> the step it holds

    def job(self, job_hash: str, llm_name: str = MODEL) -> Path:
        job_dir = self.root / job_hash
        job_dir.mkdir(parents=True, exist_ok=True)
        params = TrainParams(llm_name=llm_name, adapter_type="tokenformer")
        jobdir.write_config(job_dir, JobConfig(job_hash=job_hash, model_path="/models/tiny", params=params))
        return job_dir

    def checkpoint(self, job_hash: str, step: int, keep: int = 100) -> Path:
        from loopline.ml.train.checkpoint import save_checkpoint
        from loopline.ml.train.loop import STATE_FORMAT_VERSION

        state = {"format_version": STATE_FORMAT_VERSION, "adapter_type": "tokenformer", "step": step}
        return save_checkpoint(self.root / job_hash, step, {**self.config, "job_hash": job_hash},
                               self.tensors, state, keep)

    def staged(self, job_hash: str, step: int) -> Path:
        """A complete checkpoint in a ``.tmp-`` folder beside the others, not renamed yet."""
        done = self.checkpoint(f".scratch-{job_hash}", step)  # "." keeps it out of the watcher's sight
        root = self.root / job_hash / CHECKPOINTS_DIR
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=checkpoint_temp_prefix(step), dir=root))
        tmp.rmdir()
        done.rename(tmp)
        self._staged[tmp] = step
        return tmp

    def publish(self, tmp: Path) -> Path:
        """Rename a staged checkpoint into place, as the training program does."""
        final = tmp.with_name(checkpoint_name(self._staged.pop(tmp)))
        tmp.rename(final)
        return final


@pytest.fixture
def jobs_dir(tmp_path) -> Path:
    return tmp_path / "jobs"


@pytest.fixture
def jobs(jobs_dir, adapter) -> Jobs:
    return Jobs(jobs_dir, adapter)


class Heard:
    """Every announcement and rejected event, with the time it arrived (core subscriptions see
    JetStream publishes as they happen)."""

    def __init__(self, nc):
        self.nc = nc
        self.js = nc.jetstream()
        self.announced: list[tuple[float, str, CheckpointAnnounce]] = []
        self.rejected: list[AdapterEvent] = []
        self._changed = asyncio.Event()

    async def start(self) -> Heard:
        async def on_announce(msg) -> None:
            self.announced.append((time.time(), msg.subject,
                                   CheckpointAnnounce.model_validate_json(msg.data)))
            self._changed.set()

        async def on_reject(msg) -> None:
            self.rejected.append(AdapterEvent.model_validate_json(msg.data))
            self._changed.set()

        await self.nc.subscribe(subjects.CHECKPOINTS_ALL, cb=on_announce)
        await self.nc.subscribe(subjects.adapter_event("*", "rejected"), cb=on_reject)
        await self.nc.flush()
        return self

    def steps(self, job_hash: str) -> list[int]:
        return [a.step for _, _, a in self.announced if a.job_hash == job_hash]

    async def until(self, check, timeout_s: float = 10.0):
        """Wait until ``check()`` is truthy; returns its value."""
        deadline = time.monotonic() + timeout_s
        while not (value := check()):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"not heard within {timeout_s}s: announced "
                                   f"{[(a.job_hash, a.step) for _, _, a in self.announced]}, "
                                   f"rejected {[(r.job_hash, r.step, r.reason) for r in self.rejected]}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 0.2))
            except TimeoutError:
                pass
        return value

    async def status(self) -> dict:
        reply = await self.nc.request(subjects.SVC_CHECKPOINT_WATCHER_STATUS, b"{}", timeout=2)
        return json.loads(reply.data)["detail"]

    async def rescanned(self, times: int = 1, timeout_s: float = 10.0) -> None:
        """Wait until the watcher has finished ``times`` more full rescans than now."""
        target = (await self.status())["scans"]["full"] + times
        deadline = time.monotonic() + timeout_s
        while (await self.status())["scans"]["full"] < target:
            if time.monotonic() > deadline:
                raise TimeoutError("no rescan")
            await asyncio.sleep(0.05)


@pytest.fixture
async def heard(nats_url):
    nc = await bus.connect(nats_url, "checkpoint-watcher-test")
    await bus.ensure_topology(nc.jetstream())
    yield await Heard(nc).start()
    await nc.close()


@pytest.fixture
def start_watcher(nats_url, tmp_path, jobs_dir, heard):
    """``await start_watcher(**settings)`` starts ``python -m loopline.checkpoint_watcher`` as the
    stack does and returns once it has answered and finished its first scan."""
    procs: list[launcher.Proc] = []

    async def start(**extra) -> launcher.Proc:
        env = {
            "LOOPLINE_NATS_URL": nats_url,
            "LOOPLINE_STATE_DIR": str(tmp_path),
            "LOOPLINE_JOBS_DIR": str(jobs_dir),
            "LOOPLINE_RESCAN_INTERVAL_S": "0.5",
            **{f"LOOPLINE_{k.upper()}": str(v) for k, v in extra.items()},
        }
        proc = launcher.start_service("checkpoint-watcher", env,
                                      tmp_path / "logs" / f"checkpoint-watcher-{len(procs)}.log")
        procs.append(proc)
        deadline = time.monotonic() + 30
        while True:
            if not proc.alive():
                raise RuntimeError(f"watcher exited with {proc.popen.returncode}:\n{proc.log_tail()}")
            try:
                if (await heard.status())["scans"]["full"] >= 1:
                    return proc
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"watcher not ready:\n{proc.log_tail()}")
            await asyncio.sleep(0.05)

    yield start
    for proc in procs:
        launcher.stop(proc)
