"""``python -m loopline.trainer``: settings from LOOPLINE_* variables, logging, then the service."""

from __future__ import annotations

import asyncio
import logging
import sys

from loopline.common.settings import TrainerSettings
from loopline.trainer.service import run


def main() -> None:
    settings = TrainerSettings()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sys.exit(asyncio.run(run(settings)))


if __name__ == "__main__":
    main()
