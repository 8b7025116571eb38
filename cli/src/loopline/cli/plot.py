"""``loopline plot``: loss against step (and the learning rate, when the events carry it) to an image;
``loopline tinker plot``: the curves of a tinker-cookbook run's ``metrics.jsonl``, one panel a key."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from loopline.cli.client import EXIT_USER, CliError

EMA_FROM_POINTS = 20  # below this a smoothed line hides more than it shows
# A job directory's files (loopline.common.contracts.job_layout, which this HTTP-only package does not
# install; tests/common/test_contracts.py checks the two agree).
STATUS_FILE = "status.json"
JOB_CONFIG_FILE = "config.json"
# tinker-cookbook's ml_log.JsonLogger writes one row a step into <log_path>/metrics.jsonl; these are
# what its RL recipes (batch reward) and supervised recipes (loss) log, plotted when no key is given.
METRICS_FILE = "metrics.jsonl"
DEFAULT_METRIC_KEYS = ("env/all/reward/total", "train_mean_nll")
COLOURS = ("tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown")
Points = list[tuple[float, float]]


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


def _figure(panels: int):
    import matplotlib

    matplotlib.use("Agg")  # files only: never a window, works without a display
    from matplotlib.figure import Figure  # not pyplot: no global figure state to leak or close

    return Figure(figsize=(8, 4.5 if panels == 1 else 2.6 * panels), dpi=120, layout="constrained")


def _curve(ax, points: Points, colour: str, label: str) -> None:
    """The raw line; over it, once there are enough points to smooth, its EMA."""
    xs, values = zip(*points, strict=True)
    smooth = len(values) >= EMA_FROM_POINTS
    ax.plot(xs, values, color=colour, lw=1.2, alpha=0.5 if smooth else 1.0, marker=None if smooth else "o",
            ms=3, label=label)
    if smooth:
        ax.plot(xs, _ema(list(values)), color=colour, lw=2, label=f"{label} (EMA 0.9)")
    ax.grid(alpha=0.3)


def _save(fig, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def render(out: Path, losses: Points, lrs: Points, title: str) -> None:
    if not losses:
        raise CliError("the job has no loss history yet: nothing to plot",
                       "wait for its first steps (`loopline follow`), then plot again", EXIT_USER)
    fig = _figure(1)
    ax = fig.add_subplot()
    _curve(ax, losses, "tab:blue", "loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
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
    _save(fig, out)


def render_metrics(out: Path, series: dict[str, Points], x_label: str, title: str) -> None:
    """One panel per metric, stacked, sharing the x axis."""
    fig = _figure(len(series))
    axes = fig.subplots(len(series), 1, sharex=True, squeeze=False)[:, 0]
    # Invariant: the panels before this one each show one metric, in the order given.
    for n, (ax, (key, points)) in enumerate(zip(axes, series.items(), strict=True)):
        _curve(ax, points, COLOURS[n % len(COLOURS)], key)
        ax.legend(loc="best")
    axes[-1].set_xlabel(x_label)
    fig.suptitle(title)
    _save(fig, out)


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def load_metrics(path: Path, keys: list[str]) -> tuple[dict[str, Points], str, int]:
    """(points per key, the x axis's name, lines skipped) from a ``metrics.jsonl`` (or the folder
    that holds one). x is a row's ``step`` when it has one, else its row number; no key given: the
    DEFAULT_METRIC_KEYS the file has."""
    if path.is_dir():
        path = path / METRICS_FILE
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}",
                       f"give a {METRICS_FILE} or the recipe's log_path that holds it", EXIT_USER) from None
    rows, skipped = [], 0
    # Invariant: rows holds every JSON object among the lines before this one; skipped counts the
    # rest (a run still writing may leave its last line half-written).
    for line in lines:
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif line.strip():
            skipped += 1
    numeric = sorted({k for row in rows for k, v in row.items() if k != "step" and _number(v) is not None})
    wanted = keys or [k for k in DEFAULT_METRIC_KEYS if k in numeric]
    known = ", ".join(numeric[:12]) + (", ..." if len(numeric) > 12 else "") or "none"
    if not wanted:
        raise CliError(f"{path} has none of {', '.join(DEFAULT_METRIC_KEYS)}; its metrics: {known}",
                       "name the ones to plot with --key", EXIT_USER)
    steps = [_number(row.get("step")) for row in rows]
    xs = [float(n) if step is None else step for n, step in enumerate(steps)]
    series: dict[str, Points] = {}
    # Invariant: series holds the points of each key before this one, every one with some.
    for key in wanted:
        points = [(x, value) for x, row in zip(xs, rows, strict=True)
                  if (value := _number(row.get(key))) is not None]
        if not points:
            raise CliError(f"no row of {path} has a number for {key!r}; its metrics: {known}",
                           "check the key's spelling (--key)", EXIT_USER)
        series[key] = sorted(points)
    return series, "step" if any(step is not None for step in steps) else "row", skipped


def title_for(job_hash: str, model: str | None) -> str:
    return f"job {job_hash[:12]}" + (f" — {model}" if model else "")
