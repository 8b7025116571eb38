"""Full fine-tunes' own engines on one replica (full_weights.py, adapters.py): bounded before one
starts, a dead one noticed and unloaded, and each answering its parent replica only.

Real parts, as test_adapters_runtime.py (whose fixtures and Replica this uses): nats-server, vLLM's
server in-process on the tiny model, the replica's adapter manager and worker, and real
``vllm serve`` children, one per full fine-tune loaded. A full fine-tune's checkpoint here is the
tiny model's own weights under adapter_type "none" (what its engine serves is
tests/e2e/test_families.py's). Each child takes 30-60 s to start on CPU, so the tests share two
engine starts, in order: the bound's test leaves one version loaded for the others.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import stat
import time
from importlib.util import find_spec
from pathlib import Path

import httpx
import psutil
import pytest
import pytest_asyncio
from inference.test_adapters_runtime import (  # noqa: F401 - fixtures
    BASE,
    Replica,
    nats,
    new_hash,
    next_event,
    tiny,
)

from loopline.common.config.settings import InferenceSettings
from loopline.common.contracts.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from loopline.common.contracts.job_layout import checkpoint_name
from loopline.inference.service import flags_of, full_weights_flags
from loopline.inference.vllm_server import VllmServer
from support.checkpoints import announce_checkpoint

# Tier: a real vLLM engine per module and two `vllm serve` children, 2-4 minutes in all.
pytestmark = [pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed"),
              pytest.mark.slow]

# Two engine starts one after the other on a busy CPU, each allowed its worst case here.
ANSWER_TIMEOUT_S = 600
CHILD_MODULE = "loopline.inference.full_weights"


def full_checkpoint(root: Path, base: str) -> Path:
    """A full fine-tune's checkpoint folder (docs/adapter-format.md, "none"): every weight."""
    folder = root / checkpoint_name(1)
    folder.mkdir(parents=True)
    shutil.copy(Path(base) / "model.safetensors", folder / WEIGHTS_FILE)
    (folder / CONFIG_FILE).write_text(json.dumps({"adapter_type": "none", "step": 1}))
    return folder


def engines() -> list[psutil.Process]:
    """The full fine-tunes' engines alive under this process: `vllm serve` children."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if CHILD_MODULE in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


class EngineCount:
    """The most engines seen alive at once, and every one seen, looking every 0.1 s."""

    def __init__(self):
        self.most, self.seen = 0, set()
        self.task = asyncio.create_task(self._count())

    async def _count(self) -> None:
        while True:
            alive = await asyncio.to_thread(engines)
            self.most = max(self.most, len(alive))
            self.seen |= {p.pid for p in alive}
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        self.task.cancel()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replica(nats, tiny, tmp_path_factory):  # noqa: F811
    settings = InferenceSettings(model=tiny, served_model_name=BASE, max_inflight=8, max_adapters=4)
    assert settings.max_full_weight_engines == 1  # the default: what this module tests
    server = VllmServer(flags_of(settings, tiny), full_weights=lambda folder, name: full_weights_flags(
        settings, folder, name))
    replica = Replica(nats, server, "r-full", tmp_path_factory.mktemp("state") / "adapters", 4)
    await replica.start()
    yield replica
    await replica.stop()
    assert engines() == []


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, tiny):  # noqa: F811
    root = tmp_path_factory.mktemp("full")
    return {job: full_checkpoint(root / job, tiny) for job in (new_hash(), new_hash(), new_hash())}


def fingerprint(result) -> str:
    assert result.status == 200 and result.error is None, result.error
    return json.loads(result.text())["system_fingerprint"]


async def wait_until(condition, timeout_s: float) -> float:
    """Seconds until ``condition`` held; AssertionError after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not true after {timeout_s} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_more_full_fine_tunes_at_once_than_the_bound_queue_for_one_engine(nats, replica, jobs):  # noqa: F811
    """Requests for two full fine-tunes at once with a bound of 1: one engine at a time, both
    answered by their own version; a third, asked while they wait, is refused once its wait is
    over (503 naming the settings), and starts nothing."""
    first, second, third = jobs
    for job, folder in jobs.items():
        await announce_checkpoint(nats.js, folder, job_hash=job, base_model=BASE)
    count = EngineCount()
    try:
        asked = asyncio.gather(*(replica.results(replica.items(["Say hello."], job, max_tokens=4),
                                                 timeout_s=ANSWER_TIMEOUT_S) for job in (first, second)))
        # Once a load waits for the engine (or, unbounded, more engines start), the third asks
        # with a short wait.
        await wait_until(lambda: replica.manager.engine_queue or count.most > 1, ANSWER_TIMEOUT_S)
        replica.manager.full_engine_wait_s = 1.0
        try:
            started = time.monotonic()
            [refused] = await replica.ask(["Say hello."], third)
            refused_s = time.monotonic() - started
        finally:
            replica.manager.full_engine_wait_s = InferenceSettings().full_weights_queue_timeout_s
        [[answer_1], [answer_2]] = await asked
    finally:
        count.stop()
    print(f"\nengines at once: at most {count.most}, {len(count.seen)} started; the third refused "
          f"after {refused_s:.1f} s")
    assert count.most == 1 and len(count.seen) == 2
    assert fingerprint(answer_1) == f"{first}@1" and fingerprint(answer_2) == f"{second}@1"
    assert refused.status == 503 and refused.error is not None, refused
    assert "LOOPLINE_MAX_FULL_WEIGHT_ENGINES" in refused.error.message
    assert "LOOPLINE_FULL_WEIGHTS_QUEUE_TIMEOUT_S" in refused.error.message
    assert refused_s < 30  # its own wait, not the engines' starts
    assert third not in replica.manager.loaded() and replica.manager.full_engines == 1


async def test_a_full_fine_tunes_engine_answers_its_replica_only(replica, jobs):
    """The loaded engine listens on no port, on a socket no other uid may open, and its /v1
    routes want the key only its replica holds."""
    [engine] = engines()
    version = next(v for v in replica.manager.current.values() if v.full)
    model = version.handle
    assert model.proc.pid == engine.pid
    assert not [c for c in engine.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    mode = model.socket_dir.stat().st_mode
    assert stat.S_IMODE(mode) == 0o700 and model.socket_dir.stat().st_uid == os.geteuid()
    assert model.key not in " ".join(engine.cmdline())  # argv is readable by every uid

    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(model.socket)),
                                 base_url="http://child") as anyone:
        assert (await anyone.get("/v1/models")).status_code == 401
        keyed = await anyone.get("/v1/models", headers={"authorization": f"Bearer {model.key}"})
        assert keyed.status_code == 200 and keyed.json()["data"][0]["id"] == model.lora_name

    if os.geteuid() == 0:  # another uid, as a job's own code runs: cannot even connect
        assert await asyncio.to_thread(connect_as, NOBODY, model.socket) == "PermissionError"
    rss = sum(p.memory_info().rss for p in [engine, *engine.children(recursive=True)])
    print(f"\none full fine-tune's engine (tiny model): {rss / 2**20:.0f} MiB RSS")


def group_alive(pgid: int) -> list[int]:
    """The processes of group ``pgid`` still running (a zombie holds no memory)."""
    alive = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return alive


NOBODY = 65534


def connect_as(uid: int, path: Path) -> str:
    """What connecting to ``path`` as ``uid`` meets, from a forked child (a fresh interpreter may
    not be executable by that uid)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one syscall, then _exit, whatever the parent's threads hold
        outcome = b"connected"
        try:
            os.setuid(uid)
            socket.socket(socket.AF_UNIX).connect(str(path))
        except OSError as exc:
            outcome = type(exc).__name__.encode()
        os.write(write, outcome)
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as answer:
        return answer.read().decode()


async def test_a_dead_engine_is_noticed_unloaded_and_reported(nats, replica):  # noqa: F811
    version = next(v for v in replica.manager.current.values() if v.full)
    events = await nats.events(version.job_hash)
    pid = version.handle.proc.pid
    os.kill(pid, signal.SIGKILL)
    noticed_s = await wait_until(lambda: version.job_hash not in replica.manager.loaded()
                                 and replica.manager.full_engines == 0, 10)
    report = await next_event(events, "rejected", replica="r-full")
    print(f"\nthe engine's death noticed and its version unloaded in {noticed_s:.2f} s")
    assert report.step == version.step and "killed by signal 9" in (report.reason or ""), report
    assert "restarts at the next request" in (report.reason or "")
    await wait_until(lambda: not group_alive(pid), 5)  # its engine core went with it
    assert not version.handle.socket_dir.exists()
