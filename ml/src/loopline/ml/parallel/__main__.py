"""``python -m loopline.ml.parallel --job-dir DIR``: one TP rank of a training job.

Launch one process per rank: ``srun python -m loopline.ml.parallel --job-dir DIR`` in an
``sbatch --ntasks=N`` job, or ``torchrun --nproc-per-node N -m loopline.ml.parallel --job-dir DIR``.
The world size must equal ``params.tensor_parallel`` (when given): there is no data parallelism.
Exit status 0 when the job completed, 1 when it failed (rank 0 has written FAILED and the error).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from loopline.ml.train.status import JobReporter

from .distributed import launch_from_env

log = logging.getLogger("loopline.ml.parallel")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loopline.ml.parallel",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--job-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    # What megatron asks for with its async dgrad all-reduce on GPUs (it warns otherwise).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    job_dir = args.job_dir.resolve()
    launch = launch_from_env()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank {launch.rank} %(levelname)s %(name)s: %(message)s")

    reporter = JobReporter(job_dir) if launch.rank == 0 else None
    try:
        # Imported here so that a missing megatron-core is reported as the job's error.
        from .config import ParallelJobConfig
        from .distributed import tensor_parallel_group
        from .loop import run_job

        config = ParallelJobConfig.read(job_dir)
        tp = config.params.tensor_parallel or launch.world_size
        if tp != launch.world_size:
            raise ValueError(f"tensor_parallel={tp} but {launch.world_size} ranks were launched: "
                             f"launch exactly tensor_parallel ranks (there is no data parallelism)")
        if reporter:
            reporter.status["max_steps"] = config.params.max_steps
        with tensor_parallel_group(launch, tp) as device:
            run_job(job_dir, config, reporter, device)
        return 0
    except Exception as exc:
        log.exception("training failed")
        if reporter:
            error = f"{type(exc).__name__}: {exc}"
            reporter.write(status="FAILED", error=error)
            reporter.event("failed", step=reporter.status["step"], max_steps=reporter.status["max_steps"],
                           loss=reporter.status["loss"], error=error)
        return 1
    finally:
        if reporter:
            reporter.close()


if __name__ == "__main__":
    sys.exit(main())
