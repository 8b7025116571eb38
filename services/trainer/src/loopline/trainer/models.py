"""Which model folder a job trains, decided without importing torch or loopline.ml.

Mirrors ``loopline.ml.models.resolve.resolve_model``'s rules but never builds or downloads anything:
the trainer only writes a path into config.json, and the training program (which has torch and the
Hub client) loads it. A name we cannot find locally is passed through as a Hugging Face id, which
``from_pretrained`` resolves from the Hub cache.
"""

from __future__ import annotations

from pathlib import Path

# Built-in names of the tiny test model; resolve_model builds it into <models_dir>/tiny.
TINY_NAMES = ("tiny", "loopline/tiny")


def resolve_model_path(name: str, models_dir: Path) -> str:
    local = Path(name).expanduser()
    if local.is_dir():
        return str(local.resolve())
    models_dir = Path(models_dir).expanduser()
    if name.lower() in TINY_NAMES:
        candidate = models_dir / "tiny"
    else:
        # Prepared models live under their repo name's last part (SmolLM2-135M-Instruct).
        candidate = models_dir / name.rstrip("/").split("/")[-1]
    if candidate.is_dir():
        return str(candidate.resolve())
    return name
