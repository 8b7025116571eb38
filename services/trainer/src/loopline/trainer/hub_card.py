"""The model card (README.md) a job is pushed to the Hub with, through huggingface_hub's ModelCard and
ModelCardData: the base model, how to load the folder, the job's hash, params and dataset hash, and
its loss curve (a table, and a plot where the ``loopline plot`` helper is installed)."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from loopline.common.contracts.hub_push import HubPushParams
from loopline.common.contracts.job_schemas import HistoryPoint
from loopline.common.contracts.train_params import canonical
from loopline.trainer.registry import Job

log = logging.getLogger(__name__)

CARD_FILE = "README.md"
PLOT_FILE = "loss.png"
# A long job's curve in the card: this many rows, evenly spread, the first and the last included.
MAX_LOSS_ROWS = 100
LIBRARY = {"lora": "peft", "none": "transformers"}  # Tokenformer: no library loads it by itself
KIND_TAG = {"lora": "lora", "none": "full-fine-tune", "tokenformer": "tokenformer"}


def hub_base_model(job: Job) -> str | None:
    """The job's model as a Hub repo id, where its name is one (a local folder's name is not)."""
    name = job.llm_name
    if "/" not in name or Path(name).expanduser().is_absolute():
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def card_text(job: Job, request: HubPushParams, history: list[HistoryPoint], step: int,
              plotted: bool) -> str:
    """README.md: YAML metadata (ModelCardData), then the job in prose and tables."""
    base = hub_base_model(job)
    data = ModelCardData(base_model=base, library_name=LIBRARY.get(job.adapter_type),
                         tags=["loopline", KIND_TAG[job.adapter_type]])
    params = json.dumps(canonical(job.params), indent=2, sort_keys=True)
    loss = f"{history[-1].loss:.4f}" if history else "not recorded"
    parts = [
        f"# {request.repo_id}\n",
        f"Trained by Loopline job `{job.job_hash}` on `{job.llm_name}`: "
        f"{KIND_TAG[job.adapter_type]}, checkpoint of step {step}, final loss {loss}.\n",
        "## Loading it\n", _how_to_load(job, request, base),
        "## Training\n",
        "| | |\n|---|---|\n"
        f"| job hash | `{job.job_hash}` |\n"
        f"| dataset sha256 | `{job.dataset_sha256}` |\n"
        f"| base model | `{job.llm_name}` |\n"
        f"| adapter type | `{job.adapter_type}` |\n"
        f"| checkpoint | step {step} of {job.params.max_steps} |\n",
        f"Params (as submitted, the served model filled in):\n\n```json\n{params}\n```\n",
        "## Loss\n",
    ]
    if plotted:
        parts.append(f"![loss against step]({PLOT_FILE})\n")
    parts.append(loss_table(history))
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(parts)).content


def _how_to_load(job: Job, request: HubPushParams, base: str | None) -> str:
    repo, rev = request.repo_id, request.revision
    # A local model's name means nothing elsewhere: the reader puts in their copy of it.
    base_line = (f'BASE = "{base}"\n' if base
                 else f'BASE = "..."  # your copy of {job.llm_name!r}, the base model\n')
    revision = f', revision="{rev}"' if rev != "main" else ""
    if job.adapter_type == "none":
        return ("A full fine-tune: the whole model, with the base model's config and tokenizer.\n\n"
                "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
                f'model = AutoModelForCausalLM.from_pretrained("{repo}"{revision})\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{repo}"{revision})\n```\n')
    if job.adapter_type == "lora":
        return ("A PEFT LoRA adapter (vLLM serves it as a LoRA adapter too).\n\n"
                "```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n"
                f"{base_line}base = AutoModelForCausalLM.from_pretrained(BASE)\n"
                f'model = PeftModel.from_pretrained(base, "{repo}"{revision})\n```\n')
    return ("A Tokenformer adapter in Loopline's format (docs/adapter-format.md): key and value tokens "
            "beside each adapted linear layer. `loopline.ml` applies it to the base model; Loopline's "
            "vLLM replicas serve it.\n\n"
            "```python\nfrom huggingface_hub import snapshot_download\n"
            "from transformers import AutoModelForCausalLM\nfrom loopline.ml.adapters import apply_adapter\n"
            f'{base_line}folder = snapshot_download("{repo}"{revision})\n'
            f"model = apply_adapter(AutoModelForCausalLM.from_pretrained(BASE), folder)\n```\n")


def loss_table(history: list[HistoryPoint]) -> str:
    if not history:
        return "The job recorded no loss.\n"
    rows = history
    if len(history) > MAX_LOSS_ROWS:
        last = len(history) - 1
        picks = sorted({round(i * last / (MAX_LOSS_ROWS - 1)) for i in range(MAX_LOSS_ROWS)})
        rows = [history[i] for i in picks]
    lines = ["| step | loss |", "|---:|---:|", *(f"| {p.step} | {p.loss:.6g} |" for p in rows)]
    shown = "" if rows is history else f" ({len(rows)} of its {len(history)} steps)"
    return f"Loss by step{shown}:\n\n" + "\n".join(lines) + "\n"


def loss_plot(job: Job, history: list[HistoryPoint]) -> bytes | None:
    """The curve as a PNG, drawn by ``loopline plot``'s own renderer; None where the CLI package
    (and matplotlib) is not installed beside the trainer, or there is nothing to draw."""
    if not history:
        return None
    try:
        from loopline.cli.plot import render, title_for
    except ImportError:
        return None
    with tempfile.TemporaryDirectory(prefix="loopline-card-") as tmp:
        out = Path(tmp) / PLOT_FILE
        try:
            render(out, [(p.step, p.loss) for p in history], [], title_for(job.job_hash, job.llm_name))
            return out.read_bytes()
        except Exception:  # a card without its picture beats no push at all
            log.exception("job %s: the loss plot failed; the card has the table only", job.job_hash)
            return None
