"""Tensor parallelism (megatron-core, gloo on CPU): TP=2 trains exactly as TP=1 does.

The entry point runs as real processes: two ranks that meet through RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT (what torchrun sets), and one rank alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core",
                    reason="megatron-core is not installed (the ml package's megatron extra)")

from loopline.common.contracts.adapter_format import WEIGHTS_FILE
from loopline.common.contracts.job_layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    DATASET_FILE,
    EVENTS_FILE,
    STATUS_FILE,
    checkpoint_name,
)
from loopline.common.local.launcher import free_port
from loopline.ml.parallel.distributed import first_slurm_host, launch_from_env, slurm_port
from loopline.ml.parallel.sharding import Shard, to_full, to_local

# Tier: megatron-core's process groups and several ranks, ~10 s a test.
pytestmark = pytest.mark.slow

PAIRS = [
    ("What is the capital of France?", " Paris."),
    ("2 + 2 =", " 4"),
    ("Name a primary colour:", " blue, like the sky"),
]
# batch 2 x accumulation 2: padding, accumulation and the epoch wrap-around all happen; clipping
# at 1.0 is active in most steps (grad norms of 1-20), so the cross-rank norm is exercised too.
PARAMS = {"max_steps": 20, "learning_rate": 3e-3, "seed": 0, "batch_size": 2,
          "gradient_accumulation_steps": 2, "gradient_clip_value": 1.0, "steps_per_checkpoint": 10}
FINAL = f"{CHECKPOINTS_DIR}/{checkpoint_name(20)}"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def write_job(job_dir: Path, model: str, tp: int) -> Path:
    job_dir.mkdir(parents=True)
    config = {"job_hash": f"tp{tp}", "model_path": model, "params": {**PARAMS, "tensor_parallel": tp}}
    (job_dir / CONFIG_FILE).write_text(json.dumps(config))
    (job_dir / DATASET_FILE).write_text("".join(json.dumps({"input": q, "output": a}) + "\n"
                                                for q, a in PAIRS))
    return job_dir


def start_ranks(job_dir: Path, world: int) -> list[subprocess.Popen]:
    # A clean environment: no launcher variables leaking in from a surrounding torchrun or Slurm job;
    # one thread per rank, since the ranks share the machine's cores.
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    base["OMP_NUM_THREADS"] = "1"
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = dict(base)
        if world > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        argv = [sys.executable, "-m", "loopline.ml.parallel", "--job-dir", str(job_dir)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> None:
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-4000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_path) -> dict[int, Path]:
    """The same job trained at TP=1 (one process) and TP=2 (two processes), side by side."""
    root = tmp_path_factory.mktemp("tp")
    jobs = {tp: write_job(root / f"tp{tp}", tiny_path, tp) for tp in (1, 2)}
    procs = start_ranks(jobs[2], 2) + start_ranks(jobs[1], 1)
    finish(procs)
    return jobs


def status(job_dir: Path) -> dict:
    return json.loads((job_dir / STATUS_FILE).read_text())


def hf_model(tiny_path: str, checkpoint: Path | None = None):
    from transformers import LlamaForCausalLM

    from loopline.ml.adapters import apply_adapter

    model = LlamaForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    return apply_adapter(model, checkpoint) if checkpoint else model.eval()


def test_tp1_logits_equal_transformers(tiny_path):
    import torch.distributed as dist
    from transformers import AutoConfig

    from loopline.ml.parallel.llama import TensorParallelLlama
    from loopline.ml.parallel.mcore import parallel_state
    from loopline.ml.parallel.weights import load_hf_weights

    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # right padding, as training batches have
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                                 create_gloo_process_groups=False)
        model = TensorParallelLlama(AutoConfig.from_pretrained(tiny_path))
        load_hf_weights(model, tiny_path)
        with torch.no_grad():
            ours = model.full_logits(model(ids, mask))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    with torch.no_grad():
        theirs = hf_model(tiny_path)(input_ids=ids, attention_mask=mask).logits
    assert ours.shape == theirs.shape == (2, 24, 1024)
    # Padded positions' outputs are never used; compare the real tokens.
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[1, :15], theirs[1, :15], atol=1e-5, rtol=1e-5)


def test_tp2_losses_equal_tp1(runs):
    one, two = status(runs[1]), status(runs[2])
    assert one["status"] == two["status"] == "COMPLETED"
    assert one["step"] == two["step"] == 20 and two["error"] is None
    steps = [p["step"] for p in two["history"]]
    assert steps == [p["step"] for p in one["history"]] == list(range(1, 21))
    for a, b in zip(one["history"], two["history"], strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a, b)
    losses = [p["loss"] for p in two["history"]]
    assert losses[-1] < 0.1 * losses[0]

    events = [json.loads(line) for line in (runs[2] / EVENTS_FILE).read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "completed" and kinds.count("progress") == 20
    progress = [e for e in events if e["kind"] == "progress"]
    assert all(e["max_steps"] == 20 and e["tokens_per_s"] > 0 and e["learning_rate"] > 0 for e in progress)


def test_tp2_checkpoint_loads_into_transformers_and_matches_tp1(runs, tiny_path):
    from safetensors.torch import load_file

    from loopline.ml.adapters import read_adapter_config

    ckpt = {tp: runs[tp] / FINAL for tp in (1, 2)}
    config = read_adapter_config(ckpt[2])
    assert config["adapter_type"] == "none" and config["base_model"] == tiny_path
    kept = sorted(p.name for p in (runs[2] / CHECKPOINTS_DIR).iterdir())
    assert kept == [checkpoint_name(10), checkpoint_name(20)]

    # Full HF names and shapes: every parameter but the tied LM head, in transformers' own shapes.
    base = hf_model(tiny_path)
    one, two = (load_file(str(ckpt[tp] / WEIGHTS_FILE)) for tp in (1, 2))
    assert {k: v.shape for k, v in two.items()} == {k: v.shape for k, v in base.named_parameters()}
    moved = max(float((two[k] - p.detach()).abs().max()) for k, p in base.named_parameters())
    assert moved > 1e-2  # training changed the weights

    # Weights agree to 1e-4, bar a handful: Adam divides each update by the gradient's running RMS,
    # so a weight whose gradient is near zero moves by about +-lr per step with the sign of rounding
    # noise (TP sums in another order). Measured: 1 element of 213k off by 4e-4, all others < 3e-5
    # (the single-process program differs from TP=1 in the same way). The function must agree to 1e-4.
    for name in one:
        off = (one[name] - two[name]).abs()
        assert float(off.max()) < 2e-3, name
        assert int((off > 1e-4).sum()) <= max(1, off.numel() // 10_000), name

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    losses = []
    for tp in (1, 2):
        model = hf_model(tiny_path, ckpt[tp])
        total = 0.0
        for q, a in PAIRS:
            prompt = tok.encode(q, add_special_tokens=True)
            ids = prompt + tok.encode(a, add_special_tokens=False) + [tok.eos_token_id]
            labels = [-100] * len(prompt) + ids[len(prompt):]
            with torch.no_grad():
                total += float(model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss)
        losses.append(total / len(PAIRS))
    assert abs(losses[0] - losses[1]) < 1e-4, losses
    assert losses[1] < 0.05


def test_wrong_rank_count_fails_the_job(tmp_path, tiny_path):
    job = write_job(tmp_path / "job", tiny_path, 2)  # TP=2, but launched as one process
    (proc,) = start_ranks(job, 1)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, out[-3000:]
    result = status(job)
    assert result["status"] == "FAILED" and "tensor_parallel=2 but 1 ranks" in result["error"]
    events = [json.loads(line) for line in (job / EVENTS_FILE).read_text().splitlines()]
    assert events[-1]["kind"] == "failed" and events[-1]["error"] == result["error"]


def test_shards_round_trip():
    w = torch.arange(4 * 3 * 5, dtype=torch.float32).view(12, 5)  # 4 KV heads of 3 rows
    for shard, tp in [(Shard(0), 2), (Shard(1), 5), (Shard(None), 3),
                      (Shard(0, head_repeat=2, head_size=3), 8),  # 4 KV heads at TP=8: each twice
                      (Shard(0, vocab_rows=12), 5)]:  # 12 rows padded to 15
        pieces = [to_local(w, shard, r, tp) for r in range(tp)]
        assert torch.equal(to_full(pieces, shard), w)
    # With copied heads, ranks 2 and 3 hold head 1.
    kv = Shard(0, head_repeat=2, head_size=3)
    assert torch.equal(to_local(w, kv, 2, 8), w[3:6]) and torch.equal(to_local(w, kv, 3, 8), w[3:6])
    assert torch.equal(to_local(w, Shard(0, vocab_rows=12), 4, 5)[2:], torch.zeros(1, 5))


def test_launch_from_env():
    torchrun = launch_from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h",
                                "MASTER_PORT": "1234", "SLURM_PROCID": "0"})
    assert ((torchrun.rank, torchrun.world_size, torchrun.master_addr, torchrun.launcher)
            == (1, 2, "h", "torchrun"))
    slurm = launch_from_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                             "SLURM_JOB_NODELIST": "gpu[007-008,12],cpu1", "SLURM_JOB_ID": "4242"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.master_addr) == (3, 4, 1, "gpu007")
    assert slurm.master_port == slurm_port("4242") and slurm.launcher == "slurm"
    assert launch_from_env({}).world_size == 1
    assert first_slurm_host("localhost") == "localhost"
    assert first_slurm_host("a1,b2") == "a1"
    assert first_slurm_host("n[1-2]-ib") == "n1-ib"


def test_two_ranks_under_slurm(slurm, tmp_path, tiny_path):
    """``sbatch --ntasks=2`` + ``srun``: the ranks find each other from Slurm's variables alone."""
    job = write_job(tmp_path / "job", tiny_path, 2)
    config = json.loads((job / CONFIG_FILE).read_text())
    config["params"].update(max_steps=3, steps_per_checkpoint=3)
    (job / CONFIG_FILE).write_text(json.dumps(config))
    # Each private test cluster numbers its jobs from 1, so the port derived from the job id would
    # be the same in two test sessions at once: pin a free one (MASTER_PORT wins under Slurm too).
    script = job / "run.sh"
    script.write_text("#!/bin/bash\nexport OMP_NUM_THREADS=1\nunset MASTER_ADDR RANK WORLD_SIZE\n"
                      f"export MASTER_PORT={free_port()}\n"
                      f"srun {sys.executable} -m loopline.ml.parallel --job-dir {job}\n")
    submitted = subprocess.run(["sbatch", "--parsable", "--ntasks=2", f"--output={job}/slurm.out",
                                f"--chdir={job}", str(script)], env={**os.environ, **slurm.env},
                               capture_output=True, text=True, timeout=30, check=True)
    job_id = submitted.stdout.strip().split(";")[0]
    # Polled here: `sbatch --wait` backs off to polls tens of seconds apart.
    deadline, state = time.monotonic() + 240, ""
    while time.monotonic() < deadline:
        shown = slurm.run("scontrol", "show", "job", job_id, "-o", check=False).stdout
        state = re.search(r"JobState=(\S+)", shown).group(1) if "JobState=" in shown else ""
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(0.5)
    log = (job / "slurm.out").read_text() if (job / "slurm.out").exists() else ""
    assert state == "COMPLETED", f"job {job_id}: {state}\n{log[-4000:]}"
    assert "rank 1/2 (slurm)" in log
    result = status(job)
    assert result["status"] == "COMPLETED" and result["step"] == 3
    assert (job / CHECKPOINTS_DIR / checkpoint_name(3) / WEIGHTS_FILE).is_file()
