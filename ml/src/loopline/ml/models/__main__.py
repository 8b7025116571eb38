"""`python -m loopline.ml.models NAME [--models-dir DIR]`: print the model's local folder.

Launch scripts take the last line of stdout, so logs (and library chatter) go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path

from .resolve import DEFAULT_MODEL, ModelNotFoundError, default_models_dir, resolve_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loopline.ml.models", description=__doc__)
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        help="where built/converted models are kept (default: $LOOPLINE_MODELS_DIR "
        "or ~/.cache/loopline/models)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    try:
        # Progress bars and prints from transformers must not end up on our stdout.
        with contextlib.redirect_stdout(sys.stderr):
            path = resolve_model(args.name, args.models_dir or default_models_dir())
    except ModelNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
