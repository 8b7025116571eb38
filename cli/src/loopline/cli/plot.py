"""``loopline plot``: loss against step (and the learning rate, when the events carry it) to an image."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from loopline.cli.client import EXIT_USER, CliError

EMA_FROM_POINTS = 20  # below this a smoothed line hides more than it shows
# A job directory's files (loopline.common.job_layout, which this HTTP-only package does not
# install; tests/common/test_contracts.py checks the two agree).
STATUS_FILE = "status.json"
JOB_CONFIG_FILE = "config.json"


def load_status_file(path: Path) -> tuple[dict[str, Any], str, str | None]:
    """(job status, job hash, model) from a job directory, its status.json, or a saved TrainResponse."""
    if path.is_dir():
        path = path / STATUS_FILE
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}",
                       "give a job directory or its status.json", EXIT_USER) from None
    except ValueError as exc:
        raise CliError(f"{path} is not JSON: {exc}", None, EXIT_USER) from None
    if not isinstance(data, dict):
        raise CliError(f"{path} holds no job status (a JSON object was expected)", None, EXIT_USER)
    # A saved TrainResponse wraps the status; a job directory's status.json is the status itself.
    wrapped = "job_status" in data
    status, config = (data["job_status"], data.get("job_config") or {}) if wrapped else (data, {})
    # A job directory is named by the job's hash, so the directory name is the fallback.
    job_hash = status.get("model_name") or status.get("job_hash") or path.resolve().parent.name
    model = config.get("llm_name") or status.get("llm_name") or _llm_name_beside(path.parent)
    return status, job_hash, model


def _llm_name_beside(job_dir: Path) -> str | None:
    """The model from the job's config file (ours: config.json, the served name in its params;
    ScalarLM's: config.yaml); a line match keeps YAML out of the dependencies."""
    if (job_dir / JOB_CONFIG_FILE).is_file():
        try:
            config = json.loads((job_dir / JOB_CONFIG_FILE).read_text())
            return config.get("llm_name") or (config.get("params") or {}).get("llm_name")
        except (OSError, ValueError, AttributeError):
            return None
    if (job_dir / "config.yaml").is_file():
        match = re.search(r"^llm_name:\s*['\"]?([^'\"\n]+?)['\"]?\s*$",
                          (job_dir / "config.yaml").read_text(errors="replace"), re.MULTILINE)
        return match.group(1) if match else None
    return None


def loss_points(status: dict[str, Any]) -> list[tuple[float, float]]:
    points = [(p["step"], p["loss"]) for p in status.get("history") or []
              if isinstance(p, dict) and p.get("step") is not None and p.get("loss") is not None]
    return sorted(points)


def lr_points(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    return sorted({e["step"]: e["learning_rate"] for e in events
                   if e.get("step") is not None and e.get("learning_rate") is not None}.items())


def _ema(values: list[float], weight: float = 0.9) -> list[float]:
    # Debiased (as TensorBoard smooths): starting from 0 and dividing by 1 - weight**n keeps the
    # early points honest instead of dragging the first value along.
    out, current = [], 0.0
    for n, v in enumerate(values, start=1):
        current = weight * current + (1 - weight) * v
        out.append(current / (1 - weight**n))
    return out


def render(out: Path, losses: list[tuple[float, float]], lrs: list[tuple[float, float]], title: str) -> None:
    if not losses:
        raise CliError("the job has no loss history yet: nothing to plot",
                       "wait for its first steps (`loopline follow`), then plot again", EXIT_USER)
    import matplotlib

    matplotlib.use("Agg")  # files only: never a window, works without a display
    from matplotlib.figure import Figure  # not pyplot: no global figure state to leak or close

    fig = Figure(figsize=(8, 4.5), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    steps, values = zip(*losses, strict=True)
    ax.plot(steps, values, color="tab:blue", lw=1.2, alpha=0.5 if len(values) >= EMA_FROM_POINTS else 1.0,
            marker="o" if len(values) < EMA_FROM_POINTS else None, ms=3, label="loss")
    if len(values) >= EMA_FROM_POINTS:
        ax.plot(steps, _ema(list(values)), color="tab:blue", lw=2, label="loss (EMA 0.9)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if lrs:
        ax2 = ax.twinx()
        lr_steps, lr_values = zip(*lrs, strict=True)
        ax2.plot(lr_steps, lr_values, color="tab:orange", ls="--", lw=1.2, label="learning rate")
        ax2.set_ylabel("learning rate")
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        more_handles, more_labels = ax2.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, loc="upper right")
    ax.set_title(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def title_for(job_hash: str, model: str | None) -> str:
    return f"job {job_hash[:12]}" + (f" — {model}" if model else "")
