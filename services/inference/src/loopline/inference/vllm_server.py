"""vLLM's own OpenAI-compatible server, in-process: its engine client and its FastAPI app, called
without HTTP.

The replica does not re-declare vLLM's API: a work item carries the client's route and JSON body,
and ``call`` hands them to the app ``vllm serve`` would build from the same flags (vllm_args.py),
through the ASGI interface, in this process. Every parameter, validation error and response field
is therefore vLLM's own. Measured on the tiny model: 20 sequential completions cost the same
through the app as through ``AsyncLLM.generate`` directly (48-53 ms each, within run-to-run noise).

Adapters are vLLM LoRA adapters (Tokenformer ones converted, adapters_vllm.py): ``load_adapter``
adds one to the engine and registers it under its version's name in the serving layer's model
registry, which is how a request body's ``model`` selects it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loopline.common.config.settings import InferenceSettings
from loopline.inference.vllm_args import apply_cpu_env, on_cpu

if TYPE_CHECKING:  # vLLM is imported when the server starts, not with this module
    from fastapi import FastAPI
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)


class AdapterRejected(Exception):
    """This server cannot serve this checkpoint, whatever we retry (the message says why)."""


class EngineDead(Exception):
    """vLLM's engine is gone (its engine-core process exited, or it raised a fatal error): nothing
    this replica serves from now on can succeed, and the request at hand is not to blame."""


class _NoUvicorn:
    """What vLLM's engine-error handler reaches for as ``app.state.server`` (a uvicorn Server it
    tells to exit when the engine died): there is no uvicorn in-process, and without this the
    handler itself failed with "'State' object has no attribute 'server'" on every request after
    the engine's death. Its flag is one more sign of death that ``VllmServer.dead`` reads."""

    should_exit = False


@dataclass
class Answer:
    """What the app answered: the status, the media type and, for a response that is not a
    stream, its body (a stream's events went to ``on_event`` as they were made)."""

    status: int = 500
    media_type: str = "application/json"
    body: bytes = b""

    @property
    def streamed(self) -> bool:
        return self.media_type.startswith("text/event-stream")


@contextlib.contextmanager
def _our_log_levels() -> Iterator[None]:
    """Keep the process's logging as the runtime set it while vLLM's server modules load: one of
    them (model_hosting_container_standards, for SageMaker) sets the root logger and its handlers to
    ERROR when imported, which silenced every INFO and WARNING line of the replica after start-up."""
    root = logging.getLogger()
    level, handlers = root.level, [(h, h.level) for h in root.handlers]
    try:
        yield
    finally:
        root.setLevel(level)
        for handler, handler_level in handlers:
            handler.setLevel(handler_level)


def _vllm_folder(checkpoint_dir: Path, config: dict[str, Any]) -> str:
    """A folder vLLM's LoRA loader reads: the Tokenformer conversion for Tokenformer checkpoints;
    LoRA checkpoints are PEFT folders already and are copied as they are."""
    from loopline.inference.adapters_vllm import to_vllm_lora

    try:
        path, _kind = to_vllm_lora(checkpoint_dir, checkpoint_dir.with_name(checkpoint_dir.name + "-vllm"))
    except ValueError as exc:  # not servable as a vLLM adapter (the message says why)
        raise AdapterRejected(str(exc)) from exc
    return path


_FULL_WEIGHTS_START_TIMEOUT_S = InferenceSettings.model_fields["full_weights_start_timeout_s"].default


class VllmServer:
    def __init__(self, flags: list[str], full_weights: Callable[[str, str], list[str]] | None = None,
                 full_weights_start_timeout_s: float = _FULL_WEIGHTS_START_TIMEOUT_S):
        self.flags = flags  # vllm_args.serve_flags(...)
        # The flags of a full fine-tune's own engine, from its model folder and served name
        # (full_weights.py); None: full fine-tunes are refused.
        self.full_weights = full_weights
        self.full_weights_start_timeout_s = full_weights_start_timeout_s
        self.llm: AsyncLLM | None = None  # start() makes it
        self.app: FastAPI | None = None
        self.max_model_len = 0
        self.tasks: tuple[str, ...] = ()
        self._exit = contextlib.AsyncExitStack()
        # vLLM names adapters by an int id that must never be reused for other weights.
        self._lora_ids = 0
        self._children: set[Any] = set()  # the full fine-tunes' engines (FullWeightsModel) running

    async def start(self) -> None:
        if on_cpu():
            apply_cpu_env(flags=self.flags)
        with _our_log_levels():
            await self._start()

    async def _start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client_from_engine_args
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        # Exactly what `vllm serve <flags>` does before it listens, minus the socket.
        args = make_arg_parser(FlexibleArgumentParser(prog="loopline-inference")).parse_args(self.flags)
        validate_parsed_serve_args(args)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        client = await self._exit.enter_async_context(build_async_engine_client_from_engine_args(engine_args))
        tasks = await client.get_supported_tasks()
        self.app = build_app(args, tasks, client.model_config)
        await init_app_state(client, self.app.state, args, tasks)
        self.app.state.server = _NoUvicorn()
        self.llm = client  # type: ignore[assignment]  # an AsyncLLM: vLLM builds one in-process
        self.tasks = tuple(tasks)
        self.max_model_len = client.model_config.max_model_len

    @property
    def dead(self) -> str | None:
        """Why vLLM's engine can serve no more (its engine-core process exited, its output handler
        died on a fatal error), or None while it is alive. vLLM's own monitor thread notices an
        exited engine-core process within milliseconds and marks the client dead; this reads it."""
        llm = self.llm
        if llm is None:
            return None
        if not llm.errored and not (self.app is not None and self.app.state.server.should_exit):
            return None
        exited = {}
        with contextlib.suppress(Exception):  # vLLM internals: the reason is a bonus, not a need
            exited = llm.engine_core.resources.engine_manager.finished_procs()
        if exited:
            return "vLLM's engine died: " + ", ".join(f"{n} exited with {code}" for n, code in exited.items())
        return "vLLM's engine died (EngineDeadError: a fatal error in its engine core)"

    async def call(self, route: str, body: bytes, on_event: Callable[[bytes], Awaitable[None]],
                   *, method: str = "POST", gone: asyncio.Event | None = None) -> Answer:
        """Serve one request through vLLM's app. A streamed response's events go to ``on_event``
        one by one, as vLLM makes them; ``gone``, once set, tells the app its client disconnected
        (vLLM then aborts the request)."""
        assert self.app is not None, "start() first"
        answer = Answer()
        parts: list[bytes] = []
        pending = b""
        received = False
        gone = gone or asyncio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            nonlocal pending
            if message["type"] == "http.response.start":
                answer.status = message["status"]
                for key, value in message.get("headers", ()):
                    if key.lower() == b"content-type":
                        answer.media_type = value.decode("latin-1")
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if not answer.streamed:
                    parts.append(chunk)
                    return
                # One published event per SSE event, whatever the app's write boundaries.
                pending += chunk
                while (end := pending.find(b"\n\n")) >= 0:
                    event, pending = pending[:end + 2], pending[end + 2:]
                    await on_event(event)

        scope = {
            # ASGI spec 2.3: Starlette then watches receive() for the disconnect while it streams
            # (with 2.4 it waits for a failed send, which in-process never comes).
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": route, "raw_path": route.encode(),
            "root_path": "", "query_string": b"", "client": ("127.0.0.1", 0), "server": ("loopline", 0),
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
            "app": self.app,
        }
        await self.app(scope, receive, send)
        answer.body = b"".join(parts)
        if pending:
            await on_event(pending)
        return answer

    # --- adapters ---------------------------------------------------------------------------------
    async def load_adapter(self, name: str, checkpoint_dir: Path, config: dict[str, Any]) -> Any:
        """Load one checkpoint (docs/adapter-format.md) as a vLLM LoRA adapter and register it
        under ``name`` (unique per version), the ``model`` a request body names it by. The adapter
        is loaded when this returns, so the first request on it does not pay for loading."""
        from vllm.lora.request import LoRARequest

        assert self.llm is not None and self.app is not None, "start() first"
        if config.get("adapter_type") == "none":
            return await self._load_full_weights(name, checkpoint_dir)
        if not self.llm.vllm_config.lora_config:
            raise AdapterRejected("this replica's vLLM runs without LoRA support (adapters off)")
        path = await asyncio.to_thread(_vllm_folder, checkpoint_dir, config)
        self._lora_ids += 1
        registered = self.app.state.openai_serving_models.lora_requests
        if name in registered:  # the same step loaded again while the old load is still pinned
            name = f"{name}.{self._lora_ids}"
        request = LoRARequest(lora_name=name, lora_int_id=self._lora_ids, lora_path=path)
        try:
            await self.llm.add_lora(request)
        except Exception as exc:  # vLLM's refusal: rank above max_lora_rank, ...
            if why := self.dead:  # not the checkpoint's fault: no "rejected" for it
                raise EngineDead(why) from exc
            raise AdapterRejected(f"vLLM could not load the adapter: {exc}") from exc
        registered[name] = request
        return request

    async def _load_full_weights(self, name: str, checkpoint_dir: Path) -> Any:
        """A full fine-tune is a model: served by an engine of its own (full_weights.py)."""
        from loopline.inference.full_weights import FullWeightsModel, model_folder

        assert self.llm is not None
        if self.full_weights is None:
            raise AdapterRejected("a full fine-tune (adapter_type none) is a new model, not an "
                                  "adapter, and this replica serves no full fine-tunes")
        folder = await asyncio.to_thread(model_folder, Path(self.llm.model_config.model), checkpoint_dir,
                                         checkpoint_dir.with_name(checkpoint_dir.name + "-model"))
        model = FullWeightsModel(name, self.full_weights(str(folder), name),
                                 checkpoint_dir.with_name(checkpoint_dir.name + "-vllm.log"),
                                 start_timeout_s=self.full_weights_start_timeout_s)
        self._children.add(model)
        try:
            await model.start()
        except BaseException:
            self._children.discard(model)
            await model.stop()
            raise
        return model

    async def unload_adapter(self, handle: Any) -> None:
        from loopline.inference.full_weights import FullWeightsModel

        if isinstance(handle, FullWeightsModel):
            self._children.discard(handle)
            await handle.stop()
            return
        if self.app is not None:
            self.app.state.openai_serving_models.lora_requests.pop(handle.lora_name, None)
        if self.llm is not None:
            await self.llm.remove_lora(handle.lora_int_id)

    async def stop(self) -> None:
        children, self._children = self._children, set()
        await asyncio.gather(*(child.stop() for child in children), return_exceptions=True)
        self.app = None
        await self._exit.aclose()
        self.llm = None
