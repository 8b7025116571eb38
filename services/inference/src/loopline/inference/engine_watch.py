"""The replica's engine watch: the loop that ends the process when vLLM's engine dies.

vLLM's engine runs in a child process (EngineCore). When that process exits (killed, out of
memory) or raises a fatal error (a kernel that fails on this CPU, a crash in ``compute_logprobs``),
vLLM marks its client dead and every later request fails with EngineDeadError: the replica could
serve nothing ever again while still answering PING, so the gateway's /v1/health counted it up. The
watch notices within ``every_s`` (``VllmServer.dead``), hands the requests in flight back to
JetStream for another replica (``Worker.abandon``), and raises: under the runtime's exit policy
(loopline.common.runtime.service) the replica then stops answering PING and status at once, pulls
nothing more, and exits 1, and its supervisor (``make up``, compose, Kubernetes) starts a fresh one.
"""

from __future__ import annotations

import asyncio

from loopline.common.runtime.service import pause
from loopline.inference.vllm_server import VllmServer
from loopline.inference.worker import Worker

# How often the watch looks: reading the flag costs nothing, and /v1/health must show the replica
# down within seconds.
WATCH_EVERY_S = 0.2


class EngineDied(Exception):
    """vLLM's engine is gone; the message says how."""


async def watch_engine(server: VllmServer, worker: Worker, stopping: asyncio.Event, *,
                       every_s: float = WATCH_EVERY_S) -> None:
    """Return when ``stopping`` is set; raise EngineDied once the engine is dead."""
    while not await pause(stopping, every_s):
        if why := server.dead:
            await worker.abandon(why)
            raise EngineDied(f"{why}: this replica can serve nothing more; exiting so that its "
                             "supervisor starts a fresh one")
