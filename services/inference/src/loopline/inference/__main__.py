"""``python -m loopline.inference`` (and ``loopline-inference``): one inference replica under the
shared runtime."""

import os

# Before torch is imported (it reads this once). vLLM's CPU kernels keep their OpenMP threads
# spinning between steps; on a small host that starves NATS, the gateway and the queue running
# beside the engine (measured on 2 cores: 0.60 -> 0.84 of in-process throughput with 1 thread).
# Leave two cores to the rest of the platform unless the user chose.
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) - 2)))

from loopline.common.config.settings import InferenceSettings
from loopline.common.runtime import service as runtime
from loopline.inference.service import run


def main() -> None:
    runtime.main("inference", InferenceSettings, run)


if __name__ == "__main__":
    main()
