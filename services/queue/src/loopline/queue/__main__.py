"""``python -m loopline.queue``: settings from LOOPLINE_* variables, logging, then the service."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from loopline.common.settings import QueueSettings
from loopline.queue.service import run


def main() -> None:
    settings = QueueSettings()
    if settings.nice:
        os.nice(settings.nice)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sys.exit(asyncio.run(run(settings)))


if __name__ == "__main__":
    main()
