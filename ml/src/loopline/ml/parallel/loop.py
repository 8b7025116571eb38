"""The training loop on every TP rank: full fine-tuning, same steps as the single-process program.

Every rank reads the same data in the same order (the order depends only on the seed) and runs
the same steps; only the weights are split. The loss, the grad norm and the skip decision are
all-reduced values, so the ranks never disagree on what to do next. Rank 0 alone writes files.

Differences from ``loopline.ml.train``: full fine-tuning only, and no resume: a run that finds
checkpoints of an earlier run starts again from the base model (the optimizer state is sharded
and not saved), rewriting the same steps.
"""

from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path

import torch

from loopline.common.contracts.job_layout import DATASET_FILE
from loopline.ml.adapters import io as adapter_io
from loopline.ml.train.checkpoint import remove_leftovers, save_checkpoint
from loopline.ml.train.data import IGNORE, Batch, ExampleStream, collate, read_rows, tokenize
from loopline.ml.train.loop import StepResult, lr_factor
from loopline.ml.train.status import JobReporter

from .config import ParallelJobConfig
from .grads import clip_grad_norm, sum_kv_copy_grads
from .llama import TensorParallelLlama
from .mcore import vocab_parallel_cross_entropy
from .weights import gather_hf_state_dict, load_hf_weights

log = logging.getLogger(__name__)

STATE_FORMAT_VERSION = 1


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def token_losses(model: TensorParallelLlama, batch: Batch, device: torch.device) -> tuple[torch.Tensor, int]:
    """The summed loss over the batch's loss tokens (identical on every rank), and their count."""
    logits = model(batch.input_ids.to(device), batch.attention_mask.to(device))
    labels = batch.labels[:, 1:].to(device)  # position i predicts token i+1
    keep = labels != IGNORE
    # vocab_parallel_cross_entropy wants a real id everywhere (it all-reduces per position) and
    # works in place on its input: give it its own float32 copy and any id where the loss is dropped.
    shifted = logits[:, :-1].clone(memory_format=torch.contiguous_format).float()
    losses = vocab_parallel_cross_entropy(shifted, labels.masked_fill(~keep, 0))
    return (losses * keep).sum(), int(keep.sum())


def train_step(model: TensorParallelLlama, batches: list[Batch], optimizer, clip: float,
               device: torch.device) -> StepResult:
    """One optimizer step over the micro-batches: the mean loss over all the step's loss tokens."""
    loss_tokens = sum(int((b.labels[:, 1:] != IGNORE).sum()) for b in batches)
    total = 0.0
    for b in batches:
        loss_sum, _ = token_losses(model, b, device)
        if loss_tokens:
            (loss_sum / loss_tokens).backward()
        total += float(loss_sum.detach())
    loss = total / loss_tokens if loss_tokens else math.nan
    sum_kv_copy_grads(model)
    grad_norm = clip_grad_norm(model, clip)
    applied = math.isfinite(loss) and math.isfinite(grad_norm)
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, grad_norm, applied, sum(b.tokens for b in batches))


def run_job(job_dir: Path, config: ParallelJobConfig, reporter: JobReporter | None,
            device: torch.device) -> None:
    """Train to max_steps; ``reporter`` is rank 0's (None on the other ranks)."""
    from transformers import AutoConfig, AutoTokenizer

    p = config.params
    dtype = pick_dtype(p.dtype, device)
    random.seed(p.seed)
    torch.manual_seed(p.seed)

    hf_config = AutoConfig.from_pretrained(config.model_path)
    tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else hf_config.eos_token_id
    if isinstance(eos_id, list):
        eos_id = eos_id[0]
    if eos_id is None:
        raise ValueError(f"{config.model_path}: the tokenizer has no EOS token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    max_len = (p.max_seq_len if p.max_seq_len is not None
               else getattr(hf_config, "max_position_embeddings", 2048))
    examples = [tokenize(tokenizer, row, eos_id, max_len) for row in read_rows(job_dir / DATASET_FILE)]

    model = TensorParallelLlama(hf_config, dtype)
    load_hf_weights(model, config.model_path)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=p.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, p))
    stream = ExampleStream(examples, p.seed)
    checkpoint_config = adapter_io.adapter_config(
        model, "none", base_model=config.model_path,
        extra={"base_model": config.model_path, "job_hash": config.job_hash, "tensor_parallel": model.tp})

    step, skipped, train_seconds = 0, 0, 0.0
    if reporter:
        remove_leftovers(job_dir)
        reporter.status["max_steps"] = p.max_steps
        reporter.resume_from(0, 0.0, 0)
        reporter.write(status="TRAINING", error=None, accumulated_train_seconds=0.0)
        reporter.event("started", step=0, max_steps=p.max_steps, adapter_type="none", resumed_from=None,
                       examples=len(examples), tensor_parallel=model.tp)
    log.info("training %s for %d steps at TP=%d (rank %d, %d examples)", config.job_hash, p.max_steps,
             model.tp, model.tp_rank, len(examples))

    def checkpoint() -> None:
        tensors = gather_hf_state_dict(model)  # collective: every rank, rank 0 writes
        if reporter:
            state = {"format_version": STATE_FORMAT_VERSION, "adapter_type": "none", "step": step,
                     "data_cursor": stream.cursor.to_dict(), "skipped_steps": skipped,
                     "accumulated_train_seconds": train_seconds, "tensor_parallel": model.tp,
                     "resumable": False}
            path = save_checkpoint(job_dir, step, checkpoint_config, tensors, state,
                                   p.max_checkpoints_to_keep)
            reporter.event("checkpoint", step=step, path=str(path.relative_to(job_dir)),
                           created_at=time.time())

    # Invariant: at the top of each iteration every rank has taken `step` identical optimizer steps
    # on its own slices, and the stream is at the same position on every rank.
    while step < p.max_steps:
        started = time.perf_counter()
        micro = stream.take(p.batch_size * p.gradient_accumulation_steps)
        batches = [collate(micro[i:i + p.batch_size], pad_id) for i in range(0, len(micro), p.batch_size)]
        lr = float(scheduler.get_last_lr()[0])  # torch allows tensor learning rates; ours is a number
        result = train_step(model, batches, optimizer, p.gradient_clip_value, device)
        scheduler.step()
        step += 1
        skipped += not result.applied
        if not result.applied:
            log.warning("step %d: non-finite loss or gradient (loss %s, grad norm %s): update skipped",
                        step, result.loss, result.grad_norm)
        elapsed = time.perf_counter() - started
        train_seconds += elapsed
        if reporter:
            reporter.step(step=step, loss=result.loss, learning_rate=lr, tokens_per_s=result.tokens / elapsed,
                          epoch=stream.epoch_progress, train_seconds=train_seconds, skipped_steps=skipped,
                          grad_norm=result.grad_norm)
        if step % p.steps_per_checkpoint == 0 or step == p.max_steps:
            checkpoint()

    if reporter:
        reporter.write(status="COMPLETED")
        reporter.event("completed", step=step, loss=reporter.status["loss"],
                       accumulated_train_seconds=train_seconds)
