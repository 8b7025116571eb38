"""Who am I among the ranks, and the process groups: from torchrun's or Slurm's environment.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. ``srun`` sets SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST and SLURM_JOB_ID; the rendezvous address is the
first node of the job and the port is derived from the job id, so every rank computes the same
one without talking to the others (MASTER_ADDR / MASTER_PORT still win when set). With neither,
the program runs as one rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .mcore import parallel_state

log = logging.getLogger(__name__)

# Rendezvous ports for Slurm jobs: a window above the usual ephemeral range's start, so the port
# of a job differs from its neighbours' (consecutive job ids) and rarely meets a listening service.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 20000


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``gpu[03-05,9],cpu1`` -> ``gpu03``.

    Only the first host is needed (it hosts the rendezvous), so only the first item is expanded;
    zero padding is kept as written. ``scontrol show hostnames`` would need Slurm's CLI on the node.
    """
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    if not m or not (m.group(1) or m.group(2)):
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, ranges, suffix = m.groups()
    first = re.split(r"[,-]", ranges)[0] if ranges else ""
    return f"{prefix}{first}{suffix}"


def slurm_port(job_id: str) -> int:
    return SLURM_PORT_BASE + int(job_id) % SLURM_PORT_SPAN


def launch_from_env(env: Mapping[str, str] = os.environ) -> Launch:
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                      env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)), "torchrun")
    if "SLURM_PROCID" in env:
        # Inside an srun step SLURM_STEP_NUM_TASKS is the step's task count, SLURM_NTASKS the job's.
        world = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
        addr = env.get("MASTER_ADDR") or first_slurm_host(
            env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1")
        port = int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID", "0")))
        return Launch(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)), addr, port, "slurm")
    return Launch(0, 1, 0, "127.0.0.1", 0, "single")


def pick_device(launch: Launch) -> torch.device:
    if torch.cuda.is_available():
        # One GPU per rank on each node, by local rank.
        return torch.device("cuda", launch.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _limit_threads() -> None:
    # torch uses every core of the node by default; several ranks per node would oversubscribe it.
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    if cpus and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, int(cpus)))


@contextlib.contextmanager
def tensor_parallel_group(launch: Launch, tp: int, timeout_s: float = 600) -> Iterator[torch.device]:
    """Join the process group (gloo on CPU, NCCL on GPU) and megatron's TP groups; yield the device.

    ``timeout_s`` bounds how long a rank waits for the others, at start and in each collective, so
    a rank that died before the rendezvous fails the others instead of hanging the job.
    """
    _limit_threads()
    device = pick_device(launch)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if launch.world_size == 1:
        # No one to meet: an in-memory store, no port to pick.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        log.info("rank %d/%d (%s): rendezvous at %s:%d, backend %s", launch.rank, launch.world_size,
                 launch.launcher, launch.master_addr, launch.master_port, backend)
        dist.init_process_group(backend, init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                                rank=launch.rank, world_size=launch.world_size, timeout=timeout)
    try:
        # Gloo side groups are for megatron's distributed optimizer, which we do not use.
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                 create_gloo_process_groups=False)
        yield device
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

