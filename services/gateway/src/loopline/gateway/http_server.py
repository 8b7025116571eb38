"""The gateway's HTTP server: uvicorn, run as one of the runtime's loops.

The runtime owns SIGTERM and SIGINT; uvicorn's own handlers (installed with ``signal.signal``) would
replace the runtime's, so they are left out, and the server stops when the runtime says so.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from loopline.common.config.settings import GatewaySettings

# In-flight requests get this long to finish after the stop (then uvicorn cancels them): well
# inside the runtime's grace period for a loop.
GRACEFUL_SHUTDOWN_S = 5


class HttpServerFailed(Exception):
    """uvicorn could not start (e.g. the port is taken); it has logged why."""


class HttpServer(uvicorn.Server):
    def __init__(self, app: FastAPI, settings: GatewaySettings):
        config = uvicorn.Config(
            app, host=settings.host, port=settings.port, log_level="warning",
            timeout_keep_alive=settings.keep_alive_s, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            lifespan="off",  # the app's parts are started before the server (service.run)
        )
        # Load the app and the protocol classes now, so their imports are in the heap the runtime
        # freezes before serving.
        config.load()
        super().__init__(config)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    # Not named run: uvicorn.Server.run(sockets) is its own blocking entry point.
    async def serve_until(self, stopping: asyncio.Event) -> None:
        """The ``http`` loop: listen, serve until ``stopping`` is set, then let in-flight requests
        finish. The gateway is ready once it listens."""
        async def stop_when_told() -> None:
            await stopping.wait()
            self.should_exit = True  # uvicorn looks at it every 0.1 s

        stopper = asyncio.create_task(stop_when_told())
        try:
            # Invariant: uvicorn serves until should_exit, which is set only once the runtime is
            # stopping; an earlier return is a server that died.
            await self.serve()
        except SystemExit as exc:  # uvicorn's start-up failure; a SystemExit would end the event loop
            raise HttpServerFailed(f"the HTTP server could not start on {self.config.host}:"
                                   f"{self.config.port} (uvicorn exit {exc.code})") from None
        finally:
            stopper.cancel()
