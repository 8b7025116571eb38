"""``python -m loopline.queue`` (and ``loopline-queue``): the queue service under the shared runtime."""

from loopline.common.config.settings import QueueSettings
from loopline.common.runtime import service as runtime
from loopline.queue.service import run


def main() -> None:
    runtime.main("queue", QueueSettings, run)


if __name__ == "__main__":
    main()
