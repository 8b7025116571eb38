"""``python -m loopline.ml.tinker``: a Tinker session worker under the shared runtime (the trainer
writes this command into the worker's entrypoint)."""

from loopline.common.config.settings import TinkerWorkerSettings
from loopline.common.runtime import service as runtime
from loopline.ml.tinker.worker import run


def main() -> None:
    runtime.main("tinker-worker", TinkerWorkerSettings, run)


if __name__ == "__main__":
    main()
