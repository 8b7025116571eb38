"""vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``) as a subprocess:
the reference the parity test and the serving benchmark hold Loopline's gateway against.

The flags are the ones a Loopline replica computes (``loopline.inference.vllm_args.serve_flags``)
and, on a machine without a GPU, the environment gets the same CPU defaults the replica applies,
so both sides run the same engine with the same settings.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from loopline.common.local import launcher
from loopline.inference.vllm_args import apply_cpu_env, on_cpu


def serve_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ours, the replica's CPU defaults where there is no GPU, offline
    (the model is a local folder; a hub lookup would only add a network dependency), then ``env``."""
    environ = dict(os.environ)
    if on_cpu():
        apply_cpu_env(environ)
        environ["HF_HUB_OFFLINE"] = "1"
    return {**environ, **(env or {})}


@contextlib.contextmanager
def vllm_serve(flags: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 180,
               log_path: Path | None = None) -> Iterator[str]:
    """Start vLLM's server with ``flags`` on a free port and yield its base URL (no ``/v1``) once
    ``GET /health`` answers 200; stop it (SIGTERM, then SIGKILL) on exit. Its output goes to
    ``log_path`` (a file in a fresh temporary folder by default); a failed start raises with the
    log's tail."""
    if log_path is None:
        log_path = Path(tempfile.mkdtemp(prefix="vllm-serve-")) / "vllm-serve.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port = launcher.free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags,
            "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "ab", buffering=0) as log:  # the child holds its own copy of the descriptor
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=serve_env(env), start_new_session=True)
    # start_new_session: launcher.stop signals the whole group, EngineCore and any workers too.
    proc = launcher.Proc("vllm-serve", popen, log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, timeout_s)
        yield url
    finally:
        launcher.stop(proc, timeout_s=15)


def _wait_healthy(proc: launcher.Proc, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    # Invariant: the server is alive and has not yet answered /health with 200.
    while True:
        if not proc.alive():
            raise RuntimeError(f"vllm serve exited with {proc.popen.returncode}:\n{proc.log_tail(60)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"vllm serve not healthy at {url} after {timeout_s} s:\n{proc.log_tail(60)}")
        time.sleep(0.2)
