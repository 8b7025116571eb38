"""Full fine-tunes served by job hash: each loaded version is a ``vllm serve`` of its own, beside the
replica's engine, answering the requests pinned to it.

A full fine-tune (``adapter_type: "none"``) changes every weight, so vLLM cannot serve it as an
adapter of the replica's base model: it is a model. The checkpoint holds the weights under the
base model's names (docs/adapter-format.md, "none"), so the base folder's config and tokenizer with
those weights are a model folder vLLM loads. Why a process and not a second engine in this one: two
in-process vLLM engines share vLLM's global parallel state, and stopping one tore it down under
the other (measured: the first engine then failed every request, "pipeline model parallel group
is not initialized"), while a replica must unload versions all day. The child gets the replica's
own flags (vllm_args.serve_flags) with the folder as its model and LoRA off, and its answers come
through vLLM's own HTTP server, so they are vLLM's as much as the base model's are.

Each loaded version costs an engine (its weights and its KV cache): ``LOOPLINE_MAX_ADAPTERS``
bounds them with the adapters, and ``LOOPLINE_MAX_FULL_WEIGHT_ENGINES`` bounds the engines alone,
before one starts (adapters.py).

A child answers its parent replica only: it listens on a Unix socket in a directory of its own
(mode 0700, so no other uid can connect, a job's own included) rather than on a local port any
process could reach, and it requires a per-child key on vLLM's /v1 routes besides. The key reaches
it through its environment (``VLLM_API_KEY``), not its argv, which /proc shows to every uid.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from loopline.common.contracts.adapter_format import WEIGHTS_FILE
from loopline.inference.vllm_server import AdapterRejected, Answer

if TYPE_CHECKING:  # imported when a full fine-tune is loaded: httpx pulls in zstandard, which only
    import httpx  # the Tinker slice may (tests/deploy/test_tinker_slice.py)

log = logging.getLogger(__name__)

# Files of a model folder that are its weights: the checkpoint's replace them.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def model_folder(base: Path, checkpoint: Path, out: Path) -> Path:
    """``out`` as a model folder: the base model's files but its weights, linked, and the
    checkpoint's weights as ``model.safetensors`` (the checkpoint is the replica's own copy)."""
    out.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and item.name not in _WEIGHT_INDEXES:
            (out / item.name).symlink_to(item.resolve())
    (out / "model.safetensors").symlink_to((checkpoint / WEIGHTS_FILE).resolve())
    return out


class FullWeightsModel:
    """One full fine-tune's version, served by a ``vllm serve`` child process on a Unix socket."""

    def __init__(self, name: str, flags: list[str], log_path: Path, *, start_timeout_s: float):
        self.lora_name = name  # the ``model`` requests name it by (what the worker writes in)
        self.flags = flags
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s  # InferenceSettings.full_weights_start_timeout_s
        # Short, under /tmp: a socket's path must fit sockaddr_un (108 bytes), which a state
        # directory's may not. mkdtemp makes it 0700.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="loopline-full-"))
        self.socket = self.socket_dir / "vllm.sock"
        self.key = secrets.token_urlsafe(32)
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping = False  # stop() was called: the child's exit is ours, not a death
        import httpx

        self.http = httpx.AsyncClient(base_url="http://full-weights", timeout=None,
                                      transport=httpx.AsyncHTTPTransport(uds=str(self.socket)),
                                      headers={"authorization": f"Bearer {self.key}"})

    async def start(self) -> None:
        """Start the child and wait until it answers /health; AdapterRejected (with the end of its
        log) if it exits first or takes longer than ``start_timeout_s``."""
        command = [sys.executable, "-m", __name__, *self.flags, "--uds", str(self.socket)]
        out = await asyncio.to_thread(open, self.log_path, "ab")
        try:  # the child keeps its own descriptor
            self.proc = await asyncio.create_subprocess_exec(
                *command, stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "VLLM_API_KEY": self.key})
        finally:
            out.close()
        import httpx

        deadline = time.monotonic() + self.start_timeout_s
        # Invariant: the child is alive and has not answered /health yet.
        while True:
            if self.proc.returncode is not None:
                raise AdapterRejected(f"vLLM could not serve the full fine-tune: {self._log_tail()}")
            if time.monotonic() > deadline:
                await self.stop()
                raise AdapterRejected(f"vLLM did not start the full fine-tune in {self.start_timeout_s:.0f} "
                                      "s (LOOPLINE_FULL_WEIGHTS_START_TIMEOUT_S)")
            with contextlib.suppress(httpx.HTTPError):
                if (await self.http.get("/health", timeout=2)).status_code == 200:
                    return
            await asyncio.sleep(0.5)

    def _log_tail(self, lines: int = 5) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-lines:])
        return "(no log)"

    async def call(self, route: str, body: bytes, on_event: Callable[[bytes], Awaitable[None]],
                   *, method: str = "POST", gone: asyncio.Event | None = None) -> Answer:
        """As VllmServer.call, over HTTP: a streamed answer's events go to ``on_event`` one by one;
        ``gone`` (the client disconnected) closes the connection, which makes vLLM abort."""
        answer = Answer()
        request = self.http.build_request(method, route, content=body,
                                          headers={"content-type": "application/json"})
        exchange = asyncio.ensure_future(self._exchange(request, answer, on_event))
        waiters = [exchange] + ([asyncio.ensure_future(gone.wait())] if gone is not None else [])
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
            # A cancelled task is done only once it has run its cancellation.
            await asyncio.gather(*waiters, return_exceptions=True)
        if exchange.cancelled():
            return answer  # the client is gone: nobody reads this
        if (exc := exchange.exception()) is not None:
            answer.status, answer.media_type = 503, "application/json"
            answer.body = (b'{"error": {"message": "the full fine-tune\'s engine is not answering: '
                           + type(exc).__name__.encode() + b'", "type": "service_unavailable", "code": 503}}')
        return answer

    async def _exchange(self, request: httpx.Request, answer: Answer,
                        on_event: Callable[[bytes], Awaitable[None]]) -> None:
        response = await self.http.send(request, stream=True)
        try:
            answer.status = response.status_code
            answer.media_type = response.headers.get("content-type", answer.media_type)
            if not answer.streamed:
                answer.body = await response.aread()
                return
            pending = b""
            async for chunk in response.aiter_raw():
                pending += chunk
                while (end := pending.find(b"\n\n")) >= 0:
                    event, pending = pending[:end + 2], pending[end + 2:]
                    await on_event(event)
            if pending:
                await on_event(pending)
        finally:
            await response.aclose()

    async def exited(self) -> str:
        """Wait for the child to exit by itself (not by ``stop``), and say how: what the replica
        reports when a loaded version's engine dies. asyncio hears the exit from the kernel at
        once, so a death is noticed as it happens, not at the next poll."""
        assert self.proc is not None, "start() first"
        code = await self.proc.wait()
        how = f"killed by signal {-code}" if code < 0 else f"exited with {code}"
        return f"the full fine-tune's engine {how} ({self._log_tail(2)})"

    async def stop(self) -> None:
        self.stopping = True
        await self.http.aclose()
        proc = self.proc
        try:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 20)
                except TimeoutError:
                    pass
            if proc is not None:
                # The child's own children (vLLM's engine core) outlive a child that was killed:
                # the group goes too, or an orphaned engine keeps its memory.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        finally:
            await asyncio.to_thread(shutil.rmtree, self.socket_dir, True)


def child_main() -> None:
    """The child's entry (``python -m loopline.inference.full_weights <vllm serve flags>``): ask the
    kernel for SIGTERM when the replica dies, however it dies (a SIGKILL leaves it no time to stop
    its children, and an orphaned engine holds gigabytes), then run vLLM's OpenAI server."""
    import ctypes
    import runpy

    pr_set_pdeathsig = 1  # prctl(2)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() == 1:  # the replica died before the request took effect
        sys.exit(1)
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    child_main()
