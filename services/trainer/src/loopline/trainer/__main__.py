"""``python -m loopline.trainer``: settings from LOOPLINE_* variables, logging, then the service."""

from __future__ import annotations

import sys

from loopline.common import process
from loopline.common.settings import TrainerSettings
from loopline.trainer.service import run


def main() -> None:
    settings = TrainerSettings()
    process.setup_logging("trainer", settings.log_level)
    sys.exit(process.run(run(settings)))


if __name__ == "__main__":
    main()
