"""``python -m loopline.checkpoint_watcher``: settings from LOOPLINE_* variables, logging, then the
service."""

from __future__ import annotations

import asyncio
import logging
import sys

from loopline.checkpoint_watcher.service import run
from loopline.common.settings import CheckpointWatcherSettings


def main() -> None:
    settings = CheckpointWatcherSettings()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sys.exit(asyncio.run(run(settings)))


if __name__ == "__main__":
    main()
