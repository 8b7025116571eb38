"""Fixtures for the training-program tests: job directories and the real entry point as a subprocess.

Helpers are handed out through the ``jobs`` fixture (test modules cannot import a conftest).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loopline.common.job_layout import CONFIG_FILE, DATASET_FILE, EVENTS_FILE, STATUS_FILE
from support.stacks import tiny_model

PAIRS = [
    ("What is 1 + 1?", " The answer is 2."),
    ("Name a colour.", " Blue, like the sky."),
    ("Say hello.", " Hello there!"),
]

# The documented recipe (docs/adapter-format.md): memorises PAIRS on the tiny model with the
# default Tokenformer (32 tokens) or LoRA (r 8, alpha 32). 12 steps already suffice; 30 is margin.
RECIPE = {"max_steps": 30, "learning_rate": 1e-2, "batch_size": 3, "gradient_accumulation_steps": 1}


class TrainJobs:
    pairs = PAIRS
    recipe = RECIPE

    def __init__(self, root: Path, model: str):
        self.root = root
        self.model = model

    def write(self, name: str, params: dict, pairs=PAIRS, model: str | None = None) -> Path:
        job_dir = self.root / name
        job_dir.mkdir(parents=True, exist_ok=True)
        config = {"job_hash": f"test-{name}", "model_path": model or self.model, "params": params}
        (job_dir / CONFIG_FILE).write_text(json.dumps(config))
        (job_dir / DATASET_FILE).write_text(
            "".join(json.dumps({"input": q, "output": a}) + "\n" for q, a in pairs))
        return job_dir

    @staticmethod
    def command(job_dir: Path) -> list[str]:
        return [sys.executable, "-m", "loopline.ml.train", "--job-dir", str(job_dir)]

    def run(self, job_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(job_dir), capture_output=True, text=True, timeout=timeout)

    @staticmethod
    def status(job_dir: Path) -> dict:
        return json.loads((job_dir / STATUS_FILE).read_text())

    @staticmethod
    def events(job_dir: Path) -> list[dict]:
        return [json.loads(line) for line in (job_dir / EVENTS_FILE).read_text().splitlines()]


@pytest.fixture(scope="session")
def tiny_path() -> str:
    return tiny_model()


@pytest.fixture
def jobs(tmp_path, tiny_path) -> TrainJobs:
    return TrainJobs(tmp_path, tiny_path)
