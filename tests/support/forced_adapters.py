"""Adapters whose greedy answer is known by construction, and checkpoints of them written exactly as
the training program writes them (``loopline.ml.train.checkpoint.save_checkpoint``: temp folder,
fsync, rename into ``<jobs_dir>/<job>/checkpoints/step-XXXXXXXX``).

Why construct rather than train: a test that checks "this answer came from that version" needs
each version's answer to differ from the others and to be the same whatever else shares the batch.
A trained-for-a-few-steps adapter gives answers that differ only by near-ties, which batching noise
can flip. Here each version makes the model repeat one token by a huge margin:

A Tokenformer adapter on ``down_proj`` (every layer) with two parameter tokens, keys ``+a·u`` and
``-a·u`` (``u`` a random unit vector, ``a`` large) and both values ``c·e_T`` (``e_T`` the unit
direction of token T's output-embedding row). Θ = √2·(GeLU(s), GeLU(-s))/‖…‖ with ``s = a·x·u``:
its two weights sum to a positive number near √2 whatever the sign of ``s`` is, so every position
gets about ``√2·c·e_T`` added to its residual stream. With ``c`` far above the activations, the
last hidden state points along ``e_T`` and the logits are ``E·(γ ⊙ e_T)``: T wins when its row is
the best match to itself, which ``pick_tokens`` checks on the real weights (with a margin).
Version k of a job forces token ``tokens[k]``: its answer is T repeated, recognisable at a glance.
"""

from __future__ import annotations

import time
from pathlib import Path

from loopline.common.contracts.train_params import JobConfig, TrainParams
from loopline.trainer import jobdir

KEY_SCALE = 500.0    # a: |s| stays large unless x is nearly orthogonal to u
VALUE_SCALE = 200.0  # c: far above the tiny model's activations (norms of a few units)
SPECIAL = 3          # ids 0..2 are pad/bos/eos in the tiny model's tokenizer


class ForcedAdapters:
    """Tokenformer adapters of ``model_path`` that each force one token (see the module doc)."""

    def __init__(self, model_path: str, seed: int = 0):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from loopline.ml.adapters import io as adapter_io

        self.model_path = model_path
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        model, fields = adapter_io.prepare_model(
            model, "tokenformer", tokenformer={"num_tokens": 2, "target_modules": ("down_proj",)},
            lora={}, base_model=model_path, seed=seed)
        self.template = adapter_io.adapter_tensors(model, "tokenformer")
        self.config = adapter_io.adapter_config(model, "tokenformer", base_model=model_path, extra=fields)
        self.head = model.get_output_embeddings().weight.detach().float()
        self.gamma = model.model.norm.weight.detach().float()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.generator = torch.Generator().manual_seed(seed + 1)

    def pick_tokens(self, count: int, *, margin: float = 0.25) -> list[int]:
        """``count`` tokens that each win the argmax by ``margin`` (relative) when forced, and
        decode to a visible word piece, so the answers are distinct and easy to read."""
        import torch

        direction = self.head / self.head.norm(dim=1, keepdim=True)
        logits = (direction * self.gamma) @ self.head.t()  # row T: logits when the state is e_T
        picked = []
        for token in range(SPECIAL, self.head.shape[0]):
            row = logits[token]
            best = row[token]
            others = torch.cat([row[:token], row[token + 1:]])
            text = self.tokenizer.decode([token])
            if best > 0 and (best - others.max()) / best >= margin and text.strip() and text.isprintable():
                picked.append(token)
            if len(picked) == count:
                return picked
        raise ValueError(f"only {len(picked)} tokens of {self.model_path} can be forced")

    def tensors(self, token: int) -> dict:
        """The adapter tensors that make every answer ``token`` repeated."""
        import torch

        direction = self.head[token] / self.head[token].norm()
        out = {}
        for name, template in self.template.items():
            if name.endswith("tokenformer_k"):
                u = torch.randn(template.shape[1], generator=self.generator)
                u = u / u.norm()
                out[name] = torch.stack([KEY_SCALE * u, -KEY_SCALE * u])
            else:
                out[name] = (VALUE_SCALE * direction).repeat(template.shape[0], 1)
        return out


def write_job_config(jobs_dir: Path, job_hash: str, llm_name: str) -> Path:
    """The job's config.json, written by the trainer's own writer; ``params.llm_name`` tells the
    watcher the base model (the served name: the subject the replicas follow)."""
    job_dir = Path(jobs_dir) / job_hash
    job_dir.mkdir(parents=True, exist_ok=True)
    params = TrainParams(llm_name=llm_name, adapter_type="tokenformer")
    jobdir.write_config(job_dir, JobConfig(job_hash=job_hash, model_path=llm_name, params=params))
    return job_dir


def write_checkpoint(jobs_dir: Path, job_hash: str, step: int, config: dict, tensors: dict) -> float:
    """Write ``step`` as the training program does; returns the time just after the rename into
    place (nothing is discarded after it: ``keep`` is large). The training state holds no optimizer:
    nothing resumes from these."""
    from loopline.ml.train.checkpoint import save_checkpoint
    from loopline.ml.train.loop import STATE_FORMAT_VERSION

    state = {"format_version": STATE_FORMAT_VERSION, "adapter_type": "tokenformer", "step": step}
    save_checkpoint(Path(jobs_dir) / job_hash, step, {**config, "job_hash": job_hash}, tensors, state,
                    keep=10_000)
    return time.time()
