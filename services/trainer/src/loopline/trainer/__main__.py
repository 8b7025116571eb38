"""``python -m loopline.trainer`` (and ``loopline-trainer``): the trainer under the shared runtime."""

from loopline.common.config.settings import TrainerSettings
from loopline.common.runtime import service as runtime
from loopline.trainer.service import run


def main() -> None:
    runtime.main("trainer", TrainerSettings, run)


if __name__ == "__main__":
    main()
