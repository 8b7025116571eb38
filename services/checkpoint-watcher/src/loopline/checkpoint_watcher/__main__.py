"""``python -m loopline.checkpoint_watcher``: settings from LOOPLINE_* variables, logging, then the
service."""

from __future__ import annotations

import sys

from loopline.checkpoint_watcher.service import run
from loopline.common import process
from loopline.common.settings import CheckpointWatcherSettings


def main() -> None:
    settings = CheckpointWatcherSettings()
    process.setup_logging("checkpoint-watcher", settings.log_level)
    sys.exit(process.run(run(settings)))


if __name__ == "__main__":
    main()
