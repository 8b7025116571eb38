"""The job's config.json for this program: the single-process program's params, plus the TP size.

Full fine-tuning only: ``adapter_type`` defaults to "none" here, and asking for an adapter fails
the job with a clear error rather than silently training something else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field

from loopline.ml.train.config import JobConfig, TrainParams


class ParallelParams(TrainParams):
    tensor_parallel: int | None = Field(None, ge=1)  # None: every launched rank
    adapter_type: Literal["none"] = "none"


class ParallelJobConfig(JobConfig):
    params: ParallelParams = Field(default_factory=ParallelParams)


def load_parallel_config(job_dir: Path) -> ParallelJobConfig:
    return ParallelJobConfig.model_validate(json.loads((Path(job_dir) / "config.json").read_text()))
