"""Training speed: the ml/ loop against a plain transformers + PEFT LoRA loop; Tokenformer against LoRA.

    python bench/training.py [--model HuggingFaceTB/SmolLM2-135M-Instruct] [--steps 5] [--batch-size 2]
        [--accum 1] [--repeats 4] [--rank 8] [--threads N] [--profile] [--out bench/results/training.json]

One run trains, on the same model (float32, CPU), the same deterministic {input, output} pairs, in
the same example order, with the same batch size, accumulation, learning rate, schedule, clipping
and number of steps:

  (a) baseline: a plain transformers + PEFT loop written here (``get_peft_model`` with our default
      LoRA settings, ``DataCollatorForSeq2Seq``, AdamW, ``get_linear_schedule_with_warmup``,
      the loss through the model's own ``labels=`` / ``num_items_in_batch=`` path);
  (b) ours, LoRA: ``loopline.ml.train.loop.run_job`` on a job directory, in this process — the
      training program's whole loop (data stream, collate, ``train_step``, scheduler, status.json
      and events.jsonl written every step), only without the process start;
  (c) ours, Tokenformer with ``num_tokens`` = the LoRA rank, on the same target modules, so it
      has exactly as many trainable parameters as (b).

A repetition runs each of the three once, each loading its model afresh; successive repetitions
reverse the order (a b c, c b a, ...), so (a)-(b) and (b)-(c) are always neighbours in time and
see about the same load from the other users of the machine. Only the optimizer steps are timed:
model loading, adapter set-up and the first (warm-up) step are not. A step's time runs from the
end of the previous step to the end of this one, so it includes fetching and padding the batch,
and for (b)/(c) writing status.json and the progress event. Tokens are the non-padding tokens
(attention mask ones) of the step's micro-batches; the script checks that both loops processed
the same tokens in every step. It prints tokens/s of (a) and (b), the ratio b/a with PASS/MISS
against 1.0, and the ms/step of (c) against (b). It always exits 0: targets are reported, not
enforced.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Target of ours against the baseline (tokens/s ratio, b/a).
TARGET_RATIO = 1.0
# Above this share of the machine's CPUs used by other processes during a run, say it is noisy.
NOISY_SHARE = 0.10
# Settings that change CPU training speed a lot; printed with the figures.
ENV_SHOWN = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# Names the script accepts for the default model, besides what resolve_model takes.
MODEL_ALIASES = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
                 "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
REPO = Path(__file__).resolve().parent.parent

BASELINE, OURS_LORA, OURS_TF = "a: baseline LoRA", "b: ours LoRA", "c: ours Tokenformer"

_WORDS = (
    "the a of to in on for with and or but not is are was be have do will can this that it they "
    "we you model token text data train step loss answer question user prompt reply small large "
    "fast slow time day city river mountain water fire red green blue one two three ten hundred "
    "queue worker result engine batch stream gateway latency request cache memory"
).split()


# --- data --------------------------------------------------------------------------------------------------
def make_pairs(count: int, seed: int) -> list[dict]:
    """``count`` deterministic {input, output} pairs of about 40-120 words (≈ tokens: these common
    words are one token each in SmolLM2's vocabulary); the real token lengths are printed."""
    rng = random.Random(seed)
    pairs = []
    for i in range(count):
        total = rng.randint(36, 110)  # + the "Question i:" / "Answer:" framing and EOS
        n_in = max(4, int(total * rng.uniform(0.4, 0.7)))
        question = " ".join(rng.choice(_WORDS) for _ in range(n_in))
        answer = " ".join(rng.choice(_WORDS) for _ in range(max(2, total - n_in)))
        pairs.append({"input": f"Question {i}: {question}. Answer:", "output": f" {answer}."})
    return pairs


def example_order(n_examples: int, seed: int, count: int) -> list[int]:
    """The first ``count`` example indices the training program draws (its ExampleStream over
    ``n_examples`` examples with ``seed``). The baseline samples in this very order, so both loops
    see the same micro-batches: same padding, same tokens per step, comparable losses."""
    from loopline.ml.train.data import ExampleStream

    return ExampleStream(list(range(n_examples)), seed).take(count)


# --- machine load ------------------------------------------------------------------------------------------
class CpuWindow:
    """CPU seconds this process and the whole machine spent between ``start`` and ``stop``.

    The machine is shared: ``other_share`` says what fraction of all CPUs other processes used.
    """

    def __init__(self):
        try:
            import psutil
        except ImportError:  # the load column is then left out
            psutil = None
        self.psutil = psutil
        self.t0 = self.own0 = self.machine0 = 0.0
        self.result: dict = {}

    def _own(self) -> float:
        t = self.psutil.Process().cpu_times()
        return t.user + t.system

    def _machine(self) -> float:
        t = self.psutil.cpu_times()
        return sum(v for k, v in t._asdict().items() if k not in ("idle", "iowait", "guest", "guest_nice"))

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.psutil:
            self.own0, self.machine0 = self._own(), self._machine()

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t0
        self.result = {"wall_s": wall}
        if self.psutil:
            own = self._own() - self.own0
            other = max(self._machine() - self.machine0 - own, 0.0)
            self.result.update(own_cpu_s=own, other_cpu_s=other,
                               other_share=other / (wall * (os.cpu_count() or 1)) if wall else 0.0)
        return self.result


# --- one training run ---------------------------------------------------------------------------------------
@dataclass
class Run:
    """One loop's run: per optimizer step (1-based step i at index i-1) its seconds, tokens, loss."""

    loop: str
    repeat: int
    step_s: list[float] = field(default_factory=list)   # step 1 is the warm-up: NaN, never used
    tokens: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)  # (b)/(c): the loop's own per-step time
    trainable_parameters: int = 0
    load_s: float = 0.0
    cpu: dict = field(default_factory=dict)  # over the timed steps (2..N)

    @property
    def timed(self) -> slice:
        return slice(1, None)

    @property
    def tok_per_s(self) -> float:
        t = sum(self.step_s[self.timed])
        return sum(self.tokens[self.timed]) / t if t else float("nan")

    @property
    def ms_per_step(self) -> float:
        return statistics.median(self.step_s[self.timed]) * 1000 if len(self.step_s) > 1 else float("nan")


@dataclass
class Setup:
    model_path: str
    pairs: list[dict]
    order: list[int]
    steps: int
    batch_size: int
    accum: int
    lr: float
    clip: float
    seed: int
    rank: int
    lora_alpha: float
    lora_dropout: float
    lora_targets: str | list[str]


def run_baseline(s: Setup, repeat: int) -> Run:
    """A plain transformers + PEFT LoRA loop, as one would write it without our training program."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import DataLoader
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        get_linear_schedule_with_warmup,
    )

    run = Run(BASELINE, repeat)
    t0 = time.perf_counter()
    # Same seeding as the training program: LoRA's A initialisation draws from torch's global RNG.
    random.seed(s.seed)
    torch.manual_seed(s.seed)
    tokenizer = AutoTokenizer.from_pretrained(s.model_path)
    tokenizer.padding_side = "right"
    model = AutoModelForCausalLM.from_pretrained(s.model_path, dtype=torch.float32)
    model.config.use_cache = False  # the usual training setting: no KV cache built in forward
    eos = tokenizer.eos_token_id
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = LoraConfig(r=s.rank, lora_alpha=s.lora_alpha, lora_dropout=s.lora_dropout,
                        target_modules=s.lora_targets, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    model.train()

    # Prompt with the tokenizer's special tokens, answer + EOS without; loss on the answer only.
    features = []
    for pair in s.pairs:
        prompt = tokenizer(pair["input"])["input_ids"]
        answer = tokenizer(pair["output"], add_special_tokens=False)["input_ids"] + [eos]
        features.append({"input_ids": prompt + answer, "attention_mask": [1] * (len(prompt) + len(answer)),
                         "labels": [-100] * len(prompt) + answer})
    collator = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100,
                                      return_tensors="pt")
    loader = DataLoader(features, batch_size=s.batch_size, sampler=s.order, collate_fn=collator)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=s.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=s.steps)
    run.trainable_parameters = sum(p.numel() for p in params)
    run.load_s = time.perf_counter() - t0

    batches = iter(loader)
    window = CpuWindow()
    last = time.perf_counter()
    for step in range(1, s.steps + 1):
        micro = [next(batches) for _ in range(s.accum)]
        # As transformers' Trainer does: the loss is the sum over the step's label tokens divided
        # by their count, so accumulation weighs every token alike (like ours).
        n_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
        loss = 0.0
        for b in micro:
            out = model(**b, num_items_in_batch=n_items)
            out.loss.backward()
            loss += out.loss.item()
        torch.nn.utils.clip_grad_norm_(params, s.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        now = time.perf_counter()
        run.step_s.append(now - last if step > 1 else float("nan"))
        run.tokens.append(sum(int(b["attention_mask"].sum()) for b in micro))
        run.loss.append(loss)
        last = now
        if step == 1:
            window.start()
    run.cpu = window.stop()
    del model, optimizer, loader
    gc.collect()
    return run


def run_ours(s: Setup, repeat: int, adapter_type: str, scratch: Path) -> Run:
    """The training program's own loop: ``run_job`` on a job directory, timed from its events."""
    from loopline.common.contracts.job_layout import DATASET_FILE, EVENTS_FILE
    from loopline.common.contracts.train_params import JobConfig
    from loopline.ml.train.loop import run_job
    from loopline.ml.train.status import JobReporter

    run = Run(OURS_LORA if adapter_type == "lora" else OURS_TF, repeat)
    job_dir = Path(tempfile.mkdtemp(prefix=f"train-{adapter_type}-", dir=scratch))
    params = {
        "max_steps": s.steps, "learning_rate": s.lr, "batch_size": s.batch_size,
        "gradient_accumulation_steps": s.accum, "gradient_clip_value": s.clip, "warmup_steps": 0,
        "lr_decay": "linear", "seed": s.seed, "dtype": "float32",
        # One checkpoint, after the last step's progress event: outside every timed interval.
        "steps_per_checkpoint": s.steps, "max_checkpoints_to_keep": 1,
        "adapter_type": adapter_type,
        "lora_config": {"r": s.rank, "lora_alpha": s.lora_alpha, "lora_dropout": s.lora_dropout,
                        "target_modules": s.lora_targets},
        "tokenformer_config": {"num_tokens": s.rank},  # default targets: the 7 projections
    }
    config = JobConfig(job_hash=f"bench-{adapter_type}-{repeat}", model_path=s.model_path, params=params)
    with open(job_dir / DATASET_FILE, "w", encoding="utf-8") as f:
        for pair in s.pairs:
            f.write(json.dumps(pair) + "\n")

    window = CpuWindow()

    class Reporter(JobReporter):
        """Marks the CPU window at the end of step 1 and of the last step; reports as usual."""

        def step(self, **kw):
            super().step(**kw)
            if kw["step"] == 1:
                window.start()
            elif kw["step"] == s.steps:
                window.stop()

    wall0 = time.time()  # the events' clock
    reporter = Reporter(job_dir)
    try:
        rc = run_job(job_dir, config, reporter, lambda: False)
    finally:
        reporter.close()
    if rc != 0:
        raise RuntimeError(f"run_job exited {rc}; see {job_dir}")

    events = [json.loads(line) for line in (job_dir / EVENTS_FILE).read_text().splitlines()]
    progress = [e for e in events if e["kind"] == "progress"]
    started = next(e for e in events if e["kind"] == "started")
    run.trainable_parameters = started["trainable_parameters"]
    prev_time = prev_acc = None
    for e in progress:
        # Whole loop iteration: between two progress events (each written at the end of its step).
        run.step_s.append(e["time"] - prev_time if prev_time is not None else float("nan"))
        # The loop's own timing of the step (batch + train_step + scheduler, no reporting); its
        # tokens_per_s is tokens / that time, which gives the step's tokens back.
        compute = e["accumulated_train_seconds"] - (prev_acc or 0.0)
        run.compute_s.append(compute)
        run.tokens.append(round(e["tokens_per_s"] * compute))
        run.loss.append(e["loss"] if e["loss"] is not None else float("nan"))
        prev_time, prev_acc = e["time"], e["accumulated_train_seconds"]
    run.cpu = window.result
    # Model load and set-up, up to the "started" event (as the baseline's load_s).
    run.load_s = started["time"] - wall0
    shutil.rmtree(job_dir, ignore_errors=True)
    gc.collect()
    return run


# --- profile ------------------------------------------------------------------------------------------------
def profile_steps(s: Setup, top: int = 12) -> dict:
    """Where one optimizer step spends its CPU time (torch profiler, by operator, after a warm-up
    step): ours with LoRA, the baseline's step (the model's own ``labels=`` loss) on the same
    model and batches, and ours with Tokenformer. Used to explain a ratio away from 1."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loopline.common.contracts.train_params import TrainParams
    from loopline.ml.adapters import io as adapter_io
    from loopline.ml.train.data import IGNORE, collate, tokenize
    from loopline.ml.train.loop import train_step

    def baseline_step(model, batches, optimizer, params):
        n_items = sum(int((b.labels[:, 1:] != IGNORE).sum()) for b in batches)
        for b in batches:
            out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels,
                        num_items_in_batch=n_items)
            out.loss.backward()
            out.loss.item()
        torch.nn.utils.clip_grad_norm_(params, s.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def ours_step(model, batches, optimizer, params):
        train_step(model, batches, optimizer, params, s.clip, torch.device("cpu"))

    out = {}
    tokenizer = AutoTokenizer.from_pretrained(s.model_path)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    examples = [tokenize(tokenizer, p, eos, 1 << 20) for p in s.pairs]
    n = s.batch_size * s.accum
    steps = [[collate([examples[j] for j in s.order[k * n + i:k * n + i + s.batch_size]], pad)
              for i in range(0, n, s.batch_size)] for k in range(2)]
    p = TrainParams(lora_config={"r": s.rank, "lora_alpha": s.lora_alpha, "lora_dropout": s.lora_dropout,
                                 "target_modules": s.lora_targets},
                    tokenformer_config={"num_tokens": s.rank})
    for name, kind, step in (("ours LoRA", "lora", ours_step), ("baseline LoRA", "lora", baseline_step),
                             ("ours Tokenformer", "tokenformer", ours_step)):
        torch.manual_seed(s.seed)
        model = AutoModelForCausalLM.from_pretrained(s.model_path, dtype=torch.float32)
        model.config.use_cache = False
        model, _ = adapter_io.prepare_model(model, kind, tokenformer=p.tokenformer_config.declared(),
                                            lora=p.lora_config.declared(), base_model=s.model_path,
                                            seed=s.seed)
        model.train()
        params = [q for q in model.parameters() if q.requires_grad]
        opt = torch.optim.AdamW(params, lr=s.lr)
        step(model, steps[0], opt, params)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(model, steps[1], opt, params)
        out[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
        del model, opt
        gc.collect()
    return out


# --- report -------------------------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def report(runs: list[Run], s: Setup, args, token_lengths: list[int], same_ids: bool) -> dict:
    by = {name: [r for r in runs if r.loop == name] for name in (BASELINE, OURS_LORA, OURS_TF)}
    a, b, c = by[BASELINE], by[OURS_LORA], by[OURS_TF]
    # Pairs run next to each other, so each pair's ratio sees about the same machine load.
    ratios = [rb.tok_per_s / ra.tok_per_s for ra, rb in zip(a, b, strict=True)]
    tf_ratios = [rc.ms_per_step / rb.ms_per_step for rb, rc in zip(b, c, strict=True)]
    ratio = median(ratios)
    tf_ratio = median(tf_ratios)
    # The same step number has the same tokens in every run: step-by-step ratios of adjacent runs
    # give more samples of the same quantity (not independent of the run-level ones).
    step_ratios = [ta / tb for ra, rb in zip(a, b, strict=True)
                   for ta, tb in zip(ra.step_s[1:], rb.step_s[1:], strict=True)]
    tf_step_ratios = [tc / tb for rb, rc in zip(b, c, strict=True)
                      for tb, tc in zip(rb.step_s[1:], rc.step_s[1:], strict=True)]
    # What ours spends per step outside its own step timer: status.json and the progress event.
    report_ms = median([(x - y) * 1000 for r in b + c
                        for x, y in zip(r.step_s[1:], r.compute_s[1:], strict=True)])
    same_tokens = all(r.tokens == a[0].tokens for r in runs)
    loss_diff = max((abs(x - y) for rb in b for x, y in zip(a[0].loss, rb.loss, strict=True)),
                    default=float("nan"))
    pooled = {name: [x for r in rs for x in r.step_s[1:]] for name, rs in by.items()}
    tokens_timed = sum(a[0].tokens[1:])
    compute_tps = [sum(r.tokens[1:]) / sum(r.compute_s[1:]) for r in b]

    import torch

    print()
    print(f"Loopline training benchmark — model {args.model!r} ({s.model_path}), float32 on CPU, "
          f"torch threads: {torch.get_num_threads()}")
    print(f"  {len(s.pairs)} pairs of {min(token_lengths)}-{max(token_lengths)} tokens "
          f"(mean {statistics.mean(token_lengths):.0f}); batch {s.batch_size} x accumulation {s.accum}, "
          f"{s.steps} steps (step 1 is warm-up, not timed), lr {s.lr} linear decay, clip {s.clip}, "
          f"{args.repeats} repetitions")
    print(f"  LoRA r={s.rank} alpha={s.lora_alpha} dropout={s.lora_dropout} targets={s.lora_targets!r}; "
          f"Tokenformer num_tokens={s.rank} on the 7 projections")
    print("  " + " ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in ENV_SHOWN))
    print()
    row = "{:<24}{:>16}{:>14}{:>14}{:>16}{:>10}"
    print(row.format("", "trainable params", "tokens/s", "ms/step", "tokens/s each", "load, s"))
    for name, rs in by.items():
        print(row.format(name, f"{rs[0].trainable_parameters:,}", f"{median([r.tok_per_s for r in rs]):.1f}",
                         f"{median(pooled[name]) * 1000:.0f}", " ".join(f"{r.tok_per_s:.0f}" for r in rs),
                         f"{median([r.load_s for r in rs]):.1f}"))
    print()
    print(f"  tokens per step equal in every run: {same_tokens} "
          f"({a[0].tokens}; {tokens_timed} timed per run);"
          f" baseline token ids = ours: {same_ids}")
    print(f"  loss per step, |baseline - ours LoRA| max: {loss_diff:.2e}  (same data order and LoRA init)")
    print(f"  ours LoRA, its own tokens_per_s (step compute without status/event writing): "
          f"{median(compute_tps):.1f} tokens/s; writing status.json + the event: {report_ms:.1f} ms/step")
    print()
    print(f"  ours / baseline, tokens/s = {ratio:.3f} (median of {len(ratios)} adjacent pairs: "
          + ", ".join(f"{x:.3f}" for x in ratios)
          + f")  target >= {TARGET_RATIO}  {verdict(ratio >= TARGET_RATIO)}")
    print(f"    step by step (same tokens), baseline time / ours time: median {median(step_ratios):.3f}, "
          f"range {min(step_ratios):.3f}-{max(step_ratios):.3f} over {len(step_ratios)} steps")
    params_equal = c[0].trainable_parameters == b[0].trainable_parameters
    print(f"  Tokenformer / LoRA (ours), ms/step = {tf_ratio:.3f} "
          f"(median of {len(tf_ratios)} adjacent pairs: "
          + ", ".join(f"{x:.3f}" for x in tf_ratios) + f"); trainable parameters equal: {params_equal} "
          f"({c[0].trainable_parameters:,} vs {b[0].trainable_parameters:,})")
    print(f"    step by step, Tokenformer / LoRA time: median {median(tf_step_ratios):.3f}, "
          f"range {min(tf_step_ratios):.3f}-{max(tf_step_ratios):.3f} over {len(tf_step_ratios)} steps")

    shares = {f"{r.loop} #{r.repeat}": r.cpu.get("other_share") for r in runs if "other_share" in r.cpu}
    if shares:
        print()
        print(f"  machine load: other processes used {min(shares.values()):.0%}-{max(shares.values()):.0%} "
              f"of the {os.cpu_count()} CPUs during the timed steps "
              f"(median {median(list(shares.values())):.0%})")
        noisy = {k: v for k, v in shares.items() if v > NOISY_SHARE}
        if noisy:
            print(f"  WARNING: above {NOISY_SHARE:.0%} in {len(noisy)} of {len(shares)} runs: "
                  "absolute figures "
                  "are skewed; the ratios, measured pairwise, less so. Rerun on a quiet machine for absolute "
                  "numbers.")

    return {
        "model": args.model, "model_path": s.model_path,
        "host": {"python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count(),
                 "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "env": {k: os.environ.get(k) for k in ENV_SHOWN},
        "setup": {"pairs": len(s.pairs), "token_lengths": token_lengths, "steps": s.steps,
                  "batch_size": s.batch_size, "accum": s.accum, "lr": s.lr, "clip": s.clip, "seed": s.seed,
                  "rank": s.rank, "lora_alpha": s.lora_alpha, "lora_targets": s.lora_targets,
                  "repeats": args.repeats, "timed": "optimizer steps 2..N; load, set-up and step 1 excluded"},
        "targets": {"tokens_per_s_ratio": TARGET_RATIO},
        "figures": {
            "tokens_per_s": {name: median([r.tok_per_s for r in rs]) for name, rs in by.items()},
            "ms_per_step": {name: median(pooled[name]) * 1000 for name in by},
            "ratio_ours_over_baseline": ratio, "ratio_pairs": ratios, "ratio_pass": ratio >= TARGET_RATIO,
            "ratio_steps_median": median(step_ratios), "ratio_steps": step_ratios,
            "tokenformer_over_lora_ms": tf_ratio, "tokenformer_pairs": tf_ratios,
            "tokenformer_over_lora_steps_median": median(tf_step_ratios), "tokenformer_steps": tf_step_ratios,
            "ours_reporting_ms_per_step": report_ms,
            "trainable_parameters": {name: rs[0].trainable_parameters for name, rs in by.items()},
            "trainable_parameters_equal": params_equal,
            "ours_lora_compute_tokens_per_s": median(compute_tps),
            "tokens_equal_every_step": same_tokens, "token_ids_equal": same_ids,
            "max_loss_diff_baseline_vs_ours": loss_diff,
        },
        "other_cpu_share": shares,
        "noisy": any(v > NOISY_SHARE for v in shares.values()),
        # Step 1 (untimed) as null: JSON has no NaN.
        "runs": [{**asdict(r), "step_s": [None, *r.step_s[1:]], "tok_per_s": r.tok_per_s,
                  "ms_per_step": r.ms_per_step} for r in runs],
    }


# --- main ---------------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                        help="a resolve_model name ('tiny', the SmolLM2 repo id or 'smollm2') or a folder")
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="where models are built or found "
                             "(default: $LOOPLINE_MODELS_DIR or .loopline/models)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run; step 1 is not timed")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--repeats", type=int, default=4, help="runs of each loop, interleaved")
    parser.add_argument("--rank", type=int, default=8,
                        help="LoRA r = Tokenformer num_tokens (8: our LoRA default)")
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) - 1),
                        help="torch threads (default: CPUs - 1; 0: torch's own default, which is what "
                             "`python -m loopline.ml.train` gets)")
    parser.add_argument("--profile", action="store_true",
                        help="also print torch-profiler tables of one step: ours LoRA, the baseline, "
                             "ours Tokenformer")
    parser.add_argument("--out", type=Path, default=Path("bench/results/training.json"))
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is a warm-up and is not timed")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    from loopline.common.contracts.train_params import LoraParams
    from loopline.ml.models.resolve import resolve_model
    from loopline.ml.train.data import tokenize

    transformers.logging.set_verbosity_error()  # no load progress bars between the figures
    transformers.utils.logging.disable_progress_bar()
    # One core is left to the rest of the machine: with a thread per core, every time another
    # process takes a core the other OpenMP threads wait for it at each op's barrier, and on a
    # shared 2-core machine steps then vary several-fold from one to the next (see README).
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    models_dir = args.models_dir or Path(os.environ.get("LOOPLINE_MODELS_DIR", REPO / ".loopline" / "models"))
    model_path = str(resolve_model(MODEL_ALIASES.get(args.model.lower(), args.model), models_dir))

    lora = LoraParams()  # our defaults, which the baseline copies: alpha, dropout, targets
    pairs = make_pairs(args.pairs, args.seed)
    per_step = args.batch_size * args.accum
    order = example_order(len(pairs), args.seed, args.steps * per_step)
    s = Setup(model_path=model_path, pairs=pairs, order=order,
              steps=args.steps, batch_size=args.batch_size, accum=args.accum, lr=args.lr, clip=1.0,
              seed=args.seed, rank=args.rank, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
              lora_targets=lora.target_modules)

    # The baseline tokenizes on its own; check it gets the very ids the training program trains on.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    ours_ex = [tokenize(tok, p, tok.eos_token_id, 1 << 20) for p in pairs]
    token_lengths = [len(e.input_ids) for e in ours_ex]
    same_ids = all(e.input_ids == tok(p["input"])["input_ids"]
                   + tok(p["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                   for e, p in zip(ours_ex, pairs, strict=True))

    scratch = Path(tempfile.mkdtemp(prefix="loopline-bench-train-"))
    runs: list[Run] = []
    started = time.perf_counter()
    try:
        for rep in range(args.repeats):
            order = [BASELINE, OURS_LORA, OURS_TF]
            if rep % 2:
                order.reverse()
            for loop in order:
                if loop == BASELINE:
                    r = run_baseline(s, rep)
                else:
                    r = run_ours(s, rep, "lora" if loop == OURS_LORA else "tokenformer", scratch)
                runs.append(r)
                busy = r.cpu.get("other_share", float("nan"))
                elapsed = time.perf_counter() - started
                print(f"  [{elapsed:6.0f} s] #{rep} {loop:<22} {r.tok_per_s:7.1f} tokens/s"
                      f"  {r.ms_per_step:7.0f} ms/step  other CPU use {busy:.0%}",
                      flush=True)
        figures = report(runs, s, args, token_lengths, same_ids)
        if args.profile:
            tables = profile_steps(s)
            for kind, table in tables.items():
                print(f"\n  one step, {kind}, by operator (torch profiler, self CPU time):\n{table}")
            figures["profile"] = tables
        figures["wall_s"] = time.perf_counter() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"\nwrote {args.out} ({figures['wall_s']:.0f} s)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
