"""tinker-cookbook 0.6.1 as a client to test against: its venv (scripts/install_cookbook.sh, apart
from .venv) and its recipes run unmodified as subprocesses against a Loopline gateway, offline.

Only two recipes run offline (tinker-api.md §9): ``math_rl.train`` with ``env=arithmetic`` (it makes
its own problems) and ``chat_sl.train`` on the conversations file the package ships. Both take
``key=value`` arguments (chz) and write one row per step to ``<log_path>/metrics.jsonl``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from loopline.common.local import launcher

REPO = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO / "scripts" / "install_cookbook.sh"
MATH_RL = "tinker_cookbook.recipes.math_rl.train"
CHAT_SL = "tinker_cookbook.recipes.chat_sl.train"
# The SDK refuses a key without this prefix; a Loopline gateway accepts any key it was given.
DEFAULT_API_KEY = "tml-loopline-test"
# A cold install takes about a minute here (download and unpack ~1.6 GB); leave room for a slow mirror.
INSTALL_TIMEOUT_S = 1200

_install_result: Path | str | None = None  # the venv's python once installed, or why it failed


def cookbook_venv() -> Path:
    """Where scripts/install_cookbook.sh puts the venv (``LOOPLINE_COOKBOOK_VENV``, relative to the
    repository as the script reads it; ``.venv-cookbook`` by default)."""
    return REPO / os.environ.get("LOOPLINE_COOKBOOK_VENV", ".venv-cookbook")


def cookbook_python() -> Path:
    """The cookbook venv's python, installing it first if needed (once per process; the script
    itself returns at once when its stamp matches). A failed install fails the calling test with
    the script's output: the cookbook tests are part of the suite, so a missing client is an error,
    not a skip."""
    global _install_result
    if _install_result is None:
        _install_result = _install()
    if isinstance(_install_result, str):
        import pytest

        pytest.fail(_install_result)
    return _install_result


def _install() -> Path | str:
    venv = cookbook_venv()
    # Several pytest processes can share one checkout: the first installs, the others wait for it.
    lock_name = f"loopline-cookbook-{hashlib.sha256(str(venv).encode()).hexdigest()[:12]}.lock"
    with open(Path(tempfile.gettempdir()) / lock_name, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            done = subprocess.run(["bash", str(INSTALL_SCRIPT)], cwd=REPO, capture_output=True,
                                  text=True, timeout=INSTALL_TIMEOUT_S,
                                  env={**os.environ, "LOOPLINE_COOKBOOK_VENV": str(venv)})
        except subprocess.TimeoutExpired:
            return f"scripts/install_cookbook.sh took over {INSTALL_TIMEOUT_S} s (venv {venv})"
    if done.returncode != 0:
        return (f"scripts/install_cookbook.sh failed (exit {done.returncode}, venv {venv}):\n"
                f"{(done.stdout + done.stderr)[-4000:]}")
    return venv / "bin" / "python"


def example_conversations() -> Path:
    """The chat file the cookbook ships (128 short conversations, some with a system message)."""
    found = sorted(cookbook_venv().glob("lib/python3*/site-packages/tinker_cookbook/example_data/"
                                        "conversations.jsonl"))
    if not found:
        raise FileNotFoundError(f"no tinker_cookbook/example_data/conversations.jsonl in {cookbook_venv()}"
                                " (call cookbook_python() first)")
    return found[0]


def math_rl_args(base_url: str, model: str | Path, log_path: Path, **overrides: Any) -> dict[str, Any]:
    """RL on the arithmetic task, sized for 2 CPU cores: 8 problems x 4 samples x 16 tokens a step.

    ``loss_fn`` is ``importance_sampling`` unless overridden; ``loss_fn=None`` leaves it out, so the
    recipe trains with its own default, ``stable_reinforce`` (sampling records stability info, every
    datum carries provenance). ``renderer_name`` is set because without it the cookbook looks the
    model up in its table of Hub names and a local folder is not there. ``save_every`` (default 20)
    is the step at which it saves named checkpoints and samples from their ``tinker://`` path
    instead. An override of None drops that argument."""
    args = {"base_url": base_url, "model_name": str(model), "renderer_name": "role_colon",
            "env": "arithmetic", "group_size": 4, "groups_per_batch": 8, "max_tokens": 16,
            "max_steps": 3, "learning_rate": 3e-4, "loss_fn": "importance_sampling",
            "log_path": str(log_path), "behavior_if_log_dir_exists": "delete", **overrides}
    return {key: value for key, value in args.items() if value is not None}


def chat_sl_args(base_url: str, model: str | Path, log_path: Path, **overrides: Any) -> dict[str, Any]:
    """Supervised learning (cross_entropy) on the shipped conversations, 8 a step."""
    return {"base_url": base_url, "model_name": str(model), "renderer_name": "role_colon",
            "dataset": str(example_conversations()), "batch_size": 8, "max_steps": 3,
            "log_path": str(log_path), "behavior_if_log_dir_exists": "delete", **overrides}


def recipe_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Offline, no telemetry, a ``tml-`` key; none of the platform venv's Python paths."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TINKER_BASE_URL")}
    environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TINKER_TELEMETRY="0",
                   TOKENIZERS_PARALLELISM="false")
    environ.setdefault("TINKER_API_KEY", DEFAULT_API_KEY)
    return {**environ, **(env or {})}


class RecipeRun(NamedTuple):
    returncode: int  # negative: killed by that signal (a timeout kills it)
    log_path: Path
    metrics: list[dict[str, Any]]  # metrics.jsonl's rows, in order

    @property
    def output(self) -> str:
        """The recipe's stdout and stderr (beside log_path: the recipe empties log_path at start)."""
        return _output_file(self.log_path).read_text(errors="replace")

    def tail(self, chars: int = 4000) -> str:
        return self.output[-chars:]


def run_recipe(module: str, args: dict[str, Any], env: dict[str, str] | None = None,
               timeout: float = 600, cwd: Path | None = None, log_path: Path | None = None) -> RecipeRun:
    """Run ``python -m module key=value ...`` in the cookbook venv and wait for it (at most
    ``timeout`` seconds, then the process group is killed). ``args`` must hold ``log_path`` unless
    the recipe takes none and ``log_path`` says where it logs; the recipe runs in ``cwd`` (by
    default the folder beside its logs)."""
    log_path = Path(args["log_path"]) if log_path is None else log_path
    argv = [str(cookbook_python()), "-m", module,
            *(f"{key}={value}" for key, value in args.items())]
    out_file = _output_file(log_path)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    # cwd beside the logs: whatever the recipe writes to a relative path stays there, not in the repo.
    with open(out_file, "wb", buffering=0) as out:  # the child holds its own copy of the descriptor
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=recipe_env(env), cwd=cwd or log_path.parent, start_new_session=True)
    proc = launcher.Proc(module, popen, out_file)
    try:
        returncode = popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher.stop(proc, timeout_s=10)
        returncode = popen.wait()
    return RecipeRun(returncode, log_path, read_metrics(log_path))


def read_metrics(log_path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows; [] before the first step is logged."""
    path = log_path / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _output_file(log_path: Path) -> Path:
    return log_path.parent / f"{log_path.name}.out"
