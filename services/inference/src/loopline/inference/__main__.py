"""``python -m loopline.inference``: run one inference replica."""

import asyncio
import logging

from loopline.common.settings import InferenceSettings
from loopline.inference.service import main as serve


def main() -> None:
    settings = InferenceSettings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s inference %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
