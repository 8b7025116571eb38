"""``python -m loopline.checkpoint_watcher`` (and ``loopline-checkpoint-watcher``): the
checkpoint-watcher under the shared runtime."""

from loopline.checkpoint_watcher.service import run
from loopline.common.config.settings import CheckpointWatcherSettings
from loopline.common.runtime import service as runtime


def main() -> None:
    runtime.main("checkpoint-watcher", CheckpointWatcherSettings, run)


if __name__ == "__main__":
    main()
