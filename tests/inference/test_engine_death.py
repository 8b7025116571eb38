"""How a replica tells that vLLM's engine died (``VllmServer.dead``) and what its engine watch does
then. Unit level: a stand-in for vLLM's AsyncLLM carries the two signs vLLM gives (its ``errored``
flag, the engine-core processes' exit codes). The whole path, a real engine-core process killed
under load, is tests/e2e/test_resilience.py's."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from loopline.inference.engine_watch import EngineDied, watch_engine
from loopline.inference.vllm_server import VllmServer, _NoUvicorn


def server_with(errored: bool, exited: dict[str, int]) -> VllmServer:
    server = VllmServer([])
    manager = SimpleNamespace(finished_procs=lambda: exited)
    server.llm = SimpleNamespace(errored=errored,
                                 engine_core=SimpleNamespace(resources=SimpleNamespace(engine_manager=manager)))
    server.app = SimpleNamespace(state=SimpleNamespace(server=_NoUvicorn()))
    return server


def test_a_live_engine_is_not_dead():
    assert server_with(False, {}).dead is None
    assert VllmServer([]).dead is None  # not started (or stopped): nothing to report


def test_an_exited_engine_core_process_is_named_with_its_exit_code():
    assert server_with(True, {"EngineCore": -9}).dead == "vLLM's engine died: EngineCore exited with -9"


def test_a_fatal_engine_error_is_death_too():
    assert "EngineDeadError" in (server_with(True, {}).dead or "")


def test_vllm_telling_its_server_to_exit_is_death():
    # vLLM's engine-error handler sets this on app.state.server when it finds the engine errored.
    server = server_with(False, {})
    server.app.state.server.should_exit = True
    assert server.dead is not None


class Handed:
    def __init__(self):
        self.why: list[str] = []

    async def abandon(self, why: str) -> None:
        self.why.append(why)


async def test_the_watch_hands_the_work_back_and_raises_once_the_engine_dies():
    server, worker = server_with(False, {}), Handed()
    watch = asyncio.create_task(watch_engine(server, worker, asyncio.Event(), every_s=0.01))
    await asyncio.sleep(0.05)
    assert not watch.done() and not worker.why
    server.llm.errored = True
    with pytest.raises(EngineDied, match="engine died"):
        await asyncio.wait_for(watch, 1)
    assert len(worker.why) == 1


async def test_the_watch_returns_when_the_replica_stops():
    stopping = asyncio.Event()
    watch = asyncio.create_task(watch_engine(server_with(False, {}), Handed(), stopping, every_s=0.01))
    stopping.set()
    await asyncio.wait_for(watch, 1)


async def test_an_adapter_the_dead_engine_could_not_load_is_not_rejected(monkeypatch, tmp_path):
    """A load that fails because the engine died says so (EngineDead: the request goes to another
    replica), not "rejected", which would mark a good checkpoint unservable."""
    from loopline.inference import vllm_server
    from loopline.inference.vllm_server import AdapterRejected, EngineDead

    server = server_with(True, {"EngineCore": -9})

    async def add_lora(_request):
        raise RuntimeError("EngineCore encountered an issue")

    server.llm.add_lora = add_lora
    server.llm.vllm_config = SimpleNamespace(lora_config=object())
    server.app.state.openai_serving_models = SimpleNamespace(lora_requests={})
    monkeypatch.setattr(vllm_server, "_vllm_folder", lambda folder, config: str(folder))
    with pytest.raises(EngineDead, match="EngineCore exited with -9"):
        await server.load_adapter("job@1", tmp_path, {"adapter_type": "lora"})
    server.llm.errored = False
    with pytest.raises(AdapterRejected):  # a live engine's refusal is the checkpoint's
        await server.load_adapter("job@1", tmp_path, {"adapter_type": "lora"})
