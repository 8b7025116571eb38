"""The job's config.json for this program: the shared TrainParams (``tensor_parallel`` included).

Full fine-tuning only: ``adapter_type`` defaults to "none" here, and asking for an adapter fails
the job with a clear error rather than silently training something else. (The trainer never
launches such a job: TrainParams refuses an adapter with tensor_parallel > 1 at submit time; this
is for a job launched by hand with torchrun.)
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loopline.common.contracts.train_params import JobConfig, TrainParams


class ParallelParams(TrainParams):
    adapter_type: Literal["none"] = "none"


class ParallelJobConfig(JobConfig):
    params: ParallelParams = Field(default_factory=ParallelParams)
