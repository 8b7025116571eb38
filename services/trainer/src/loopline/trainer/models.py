"""Which model folder a job trains, decided without importing torch or loopline.ml.

The trainer never builds or downloads anything: it only writes a path into config.json, and the
training program (which has torch and the Hub client) loads it. A local folder is used as is, a
prepared one (``model_folders``, the rule loopline.ml prepares by) when it exists; any other name
is passed through as a Hugging Face id, which ``from_pretrained`` resolves from the Hub cache.
"""

from __future__ import annotations

from pathlib import Path

from loopline.common.contracts.model_folders import prepared_folder


def resolve_model_path(name: str, models_dir: Path) -> str:
    local = Path(name).expanduser()
    if local.is_dir():
        return str(local.resolve())
    candidate = prepared_folder(name, models_dir)
    if candidate.is_dir():
        return str(candidate.resolve())
    return name
