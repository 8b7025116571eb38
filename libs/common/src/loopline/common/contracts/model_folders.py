"""Where a prepared model lives under the models directory, decided without torch.

loopline.ml builds or converts models there (``resolve_model``); the trainer only looks, to write
the folder into a job's config.json (the training program loads it). Both follow this one rule:

    <models_dir>/tiny                     the built-in tiny test model ("tiny", "loopline/tiny")
    <models_dir>/<last part of the id>    a prepared Hugging Face model (SmolLM2-135M-Instruct)
"""

from __future__ import annotations

from pathlib import Path

TINY_NAMES = ("tiny", "loopline/tiny")
_TINY_FOLDER = "tiny"


def is_tiny(name: str) -> bool:
    return name.lower() in TINY_NAMES


def prepared_folder(name: str, models_dir: str | Path) -> Path:
    """Where the model ``name`` is (or would be) prepared; it may not exist yet."""
    models_dir = Path(models_dir).expanduser()
    if is_tiny(name):
        return models_dir / _TINY_FOLDER
    return models_dir / name.rstrip("/").split("/")[-1]
