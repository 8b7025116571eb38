"""``python -m loopline.queue`` (and ``loopline-queue``): the queue service under the shared runtime."""

from loopline.common import runtime
from loopline.common.settings import QueueSettings
from loopline.queue.service import run


def main() -> None:
    runtime.main("queue", QueueSettings, run)


if __name__ == "__main__":
    main()
