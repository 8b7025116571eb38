"""``python -m loopline.queue``: settings from LOOPLINE_* variables, logging, then the service."""

from __future__ import annotations

import os
import sys

from loopline.common import process
from loopline.common.settings import QueueSettings
from loopline.queue.service import run


def main() -> None:
    settings = QueueSettings()
    if settings.nice:
        os.nice(settings.nice)
    process.setup_logging("queue", settings.log_level)
    sys.exit(process.run(run(settings)))


if __name__ == "__main__":
    main()
