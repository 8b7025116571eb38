"""The training loop of one job slice: set up (or resume), step, report, checkpoint, stop.

A job may run as several Slurm slices (preemption, time limits). Each slice resumes from the
newest checkpoint with the optimizer, scheduler, data cursor and RNG states it saved, so the
losses are the same as in one uninterrupted run.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from loopline.common.contracts.job_layout import DATASET_FILE
from loopline.common.contracts.train_params import JobConfig, TrainParams
from loopline.ml.adapters import io as adapter_io

from .checkpoint import latest_checkpoint, load_training_state, remove_leftovers, save_checkpoint
from .data import IGNORE, Batch, DataCursor, ExampleStream, collate, read_rows, tokenize
from .exit_codes import EXIT_COMPLETED, EXIT_PREEMPTED
from .status import JobReporter

log = logging.getLogger(__name__)

STATE_FORMAT_VERSION = 1


def lr_factor(step: int, p: TrainParams) -> float:
    """Multiplier on the learning rate for optimizer step ``step`` (0-based).

    Warm-up rises linearly to 1 over ``warmup_steps`` steps; then the decay runs from 1 towards 0
    at ``max_steps`` (linear or cosine; the last step still has a small positive rate).
    """
    if step < p.warmup_steps:
        return (step + 1) / p.warmup_steps
    progress = (step - p.warmup_steps) / max(1, p.max_steps - p.warmup_steps)
    if p.lr_decay == "linear":
        return max(0.0, 1.0 - progress)
    if p.lr_decay == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return 1.0


def pick_device_dtype(name: str) -> tuple[torch.device, torch.dtype]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, getattr(torch, name)


@dataclass
class StepResult:
    loss: float  # mean over the step's loss tokens; nan if there were none or it overflowed
    grad_norm: float
    applied: bool  # False: non-finite, the update was skipped
    tokens: int


def train_step(model, batches: list[Batch], optimizer, params: list[torch.nn.Parameter],
               clip: float, device: torch.device) -> StepResult:
    """One optimizer step over ``batches`` (the micro-batches of gradient accumulation).

    The loss is the mean over every loss token of the step, so short and long examples weigh
    per token whatever micro-batch they land in.
    """
    loss_tokens = sum(int((b.labels[:, 1:] != IGNORE).sum()) for b in batches)
    total = 0.0
    for b in batches:
        logits = model(input_ids=b.input_ids.to(device), attention_mask=b.attention_mask.to(device)).logits
        # Position i predicts token i+1.
        loss_sum = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), b.labels[:, 1:].to(device).flatten(),
                                   ignore_index=IGNORE, reduction="sum")
        if loss_tokens:
            (loss_sum / loss_tokens).backward()
        total += loss_sum.item()
    loss = total / loss_tokens if loss_tokens else math.nan
    return apply_update(optimizer, params, clip, loss, sum(b.tokens for b in batches))


def apply_update(optimizer, params: list[torch.nn.Parameter], clip: float, loss: float,
                 tokens: int) -> StepResult:
    """The end of a step whose gradients are in place: clip, then step unless anything is
    non-finite (the update is skipped), and clear the gradients."""
    # With clipping off the call only measures the norm (the scale factor is capped at 1).
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf))
    applied = math.isfinite(loss) and math.isfinite(grad_norm)
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, grad_norm, applied, tokens)


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_model_and_data(config: JobConfig, job_dir: Path, device: torch.device, dtype: torch.dtype):
    """The base model, the tokenized examples and the padding id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    # transformers wraps PreTrainedModel.to in functools.wraps, whose type mypy does not bind as a
    # method: it takes the device for `self`.
    model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=dtype).to(device)  # type: ignore[arg-type]
    model.config.use_cache = False  # no KV cache in training: it only costs memory
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
    if isinstance(eos_id, list):
        eos_id = eos_id[0]
    if eos_id is None:
        raise ValueError(f"{config.model_path}: the tokenizer has no EOS token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    max_len = (config.params.max_seq_len if config.params.max_seq_len is not None
               else getattr(model.config, "max_position_embeddings", 2048))
    rows = read_rows(job_dir / DATASET_FILE)
    return model, [tokenize(tokenizer, row, eos_id, max_len) for row in rows], pad_id


@dataclass
class Objective:
    """What a job trains and how one of its steps goes: ScalarLM's two training modes."""

    model: torch.nn.Module
    examples: list[Any]
    collate: Callable[[list[Any]], Any]  # examples -> one micro-batch
    # (model, micro-batches, optimizer, trainable params, clip, device) -> the step's result
    step: Callable[..., StepResult]
    lora_task_type: str  # PEFT's task type for a LoRA on ``model``
    tokenformer_targets: list[str]


def language_model_objective(config: JobConfig, job_dir: Path, device: torch.device,
                             dtype: torch.dtype) -> Objective:
    model, examples, pad_id = load_model_and_data(config, job_dir, device, dtype)
    return Objective(model, examples, lambda micro: collate(micro, pad_id), train_step, "CAUSAL_LM",
                     config.params.tokenformer_config.target_modules)


def objective_of(config: JobConfig, job_dir: Path, device: torch.device, dtype: torch.dtype) -> Objective:
    if config.params.training_mode == "embedding":
        from .embedding import embedding_objective  # it imports this module

        return embedding_objective(config, job_dir, device, dtype)
    return language_model_objective(config, job_dir, device, dtype)


@dataclass
class TrainingRun:
    """Everything a checkpoint captures, and the two ways across it: save and restore."""

    job_dir: Path
    params: TrainParams
    model: torch.nn.Module
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: ExampleStream
    adapter_config: dict
    reporter: JobReporter
    step: int = 0
    skipped: int = 0
    train_seconds: float = 0.0

    def save(self) -> None:
        state = {
            "format_version": STATE_FORMAT_VERSION,
            "adapter_type": self.params.adapter_type,
            "step": self.step,
            "data_cursor": self.stream.cursor.to_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "skipped_steps": self.skipped,
            "accumulated_train_seconds": self.train_seconds,
        }
        tensors = adapter_io.adapter_tensors(self.model, self.params.adapter_type)
        path = save_checkpoint(self.job_dir, self.step, self.adapter_config, tensors, state,
                               self.params.max_checkpoints_to_keep)
        self.reporter.event("checkpoint", step=self.step, path=str(path.relative_to(self.job_dir)),
                            created_at=time.time())

    def restore(self, path: Path) -> None:
        state = load_training_state(path)
        kind = self.params.adapter_type
        if state["adapter_type"] != kind:
            raise ValueError(f"{path} holds a {state['adapter_type']} adapter, the job trains {kind}")
        adapter_io.load_adapter_tensors(self.model, kind, adapter_io.read_tensors(path))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.stream.cursor = DataCursor(**state["data_cursor"])
        self.step, self.skipped = state["step"], state["skipped_steps"]
        set_rng_state(state["rng"])


def run_job(job_dir: Path, config: JobConfig, reporter: JobReporter,
            stop_requested: Callable[[], bool]) -> int:
    """Train until max_steps (→ 0) or until ``stop_requested()`` (→ checkpoint, 143)."""
    p = config.params
    reporter.status["max_steps"] = p.max_steps
    device, dtype = pick_device_dtype(p.dtype)
    random.seed(p.seed)
    torch.manual_seed(p.seed)  # LoRA's A init draws from it

    objective = objective_of(config, job_dir, device, dtype)
    examples = objective.examples
    model, adapter_fields = adapter_io.prepare_model(
        objective.model, p.adapter_type,
        tokenformer={**p.tokenformer_config.declared(), "target_modules": objective.tokenformer_targets},
        lora=p.lora_config.declared(), base_model=config.model_path, seed=p.seed,
        lora_task_type=objective.lora_task_type)
    model.train()
    trainable = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=p.learning_rate)
    run = TrainingRun(
        job_dir, p, model, trainable, optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, p)),
        stream=ExampleStream(examples, p.seed),
        adapter_config=adapter_io.adapter_config(model, p.adapter_type, base_model=config.model_path,
                                                 extra={**adapter_fields, "job_hash": config.job_hash}),
        reporter=reporter)

    remove_leftovers(job_dir)
    resumed_from = latest_checkpoint(job_dir)
    if resumed_from is not None:
        run.restore(resumed_from[1])
    reporter.resume_from(run.step, run.stream.epoch_progress, run.skipped)
    run.train_seconds = reporter.status["accumulated_train_seconds"]
    reporter.write(status="TRAINING", error=None)
    n_trainable = sum(q.numel() for q in trainable)
    reporter.event("started", step=run.step, max_steps=p.max_steps, adapter_type=p.adapter_type,
                   training_mode=p.training_mode,
                   resumed_from=str(resumed_from[1].relative_to(job_dir)) if resumed_from else None,
                   examples=len(examples), trainable_parameters=n_trainable)
    log.info("training %s from step %d to %d (%s, %d examples, %d trainable parameters)",
             config.job_hash, run.step, p.max_steps, p.adapter_type, len(examples), n_trainable)

    last_checkpoint = run.step
    # Invariant: at the top of each iteration, model/optimizer/scheduler/stream/RNG are exactly the
    # state after `run.step` optimizer steps, which is what a checkpoint at that step holds.
    while run.step < p.max_steps and not stop_requested():
        started = time.perf_counter()
        micro = run.stream.take(p.batch_size * p.gradient_accumulation_steps)
        batches = [objective.collate(micro[i:i + p.batch_size]) for i in range(0, len(micro), p.batch_size)]
        lr = float(run.scheduler.get_last_lr()[0])  # torch allows tensor learning rates; ours is a number
        result = objective.step(model, batches, optimizer, trainable, p.gradient_clip_value, device)
        run.scheduler.step()  # also on a skipped step, so the schedule stays tied to the step number
        run.step += 1
        if not result.applied:
            run.skipped += 1
            log.warning("step %d: non-finite loss or gradient (loss %s, grad norm %s): update skipped",
                        run.step, result.loss, result.grad_norm)
        elapsed = time.perf_counter() - started
        run.train_seconds += elapsed
        reporter.step(step=run.step, loss=result.loss, learning_rate=lr, tokens_per_s=result.tokens / elapsed,
                      epoch=run.stream.epoch_progress, train_seconds=run.train_seconds,
                      skipped_steps=run.skipped, grad_norm=result.grad_norm)
        if run.step % p.steps_per_checkpoint == 0 or run.step == p.max_steps:
            saving = time.perf_counter()
            run.save()
            last_checkpoint = run.step
            run.train_seconds += time.perf_counter() - saving

    if run.step < p.max_steps:  # asked to stop (SIGTERM): save the progress, stay TRAINING for a requeue
        if run.step > last_checkpoint:
            run.save()
        reporter.write(status="TRAINING")
        log.info("stopped at step %d of %d on request; a requeued run resumes here", run.step, p.max_steps)
        return EXIT_PREEMPTED
    reporter.write(status="COMPLETED")
    reporter.event("completed", step=run.step, loss=reporter.status["loss"],
                   accumulated_train_seconds=run.train_seconds)
    return EXIT_COMPLETED
