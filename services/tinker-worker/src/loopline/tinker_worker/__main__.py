"""``python -m loopline.tinker_worker``: a Tinker session worker under the shared runtime (the trainer
writes this command into the worker's entrypoint)."""

from loopline.common.config.settings import TinkerWorkerSettings
from loopline.common.runtime import service as runtime
from loopline.tinker_worker.worker import run


def main() -> None:
    runtime.main("tinker-worker", TinkerWorkerSettings, run)


if __name__ == "__main__":
    main()
