"""What the soak samples and how it judges the samples: each service's resident memory and open file
descriptors (its whole process tree), JetStream's streams (messages, bytes, consumers) and
nats-server's own figures from its monitoring port; the start/end table; the invariants that say
nothing grew without bound and every accepted request was answered.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats

from loopline.common.contracts import subjects
from loopline.common.contracts.tinker_names import TINKER_DIR
from loopline.common.local.stack import LocalStack
from support.soak_load import quiet

# nats-server's /varz figures worth following over hours.
VARZ_FIELDS = ("mem", "connections", "subscriptions", "slow_consumers", "in_msgs", "out_msgs")


@dataclass(frozen=True)
class Limits:
    """How much growth between the start sample and the end sample is still "bounded"."""

    rss_ratio: float = 1.5  # per service, end / start, after warm-up
    rss_slack_mb: float = 40.0  # growth under this is noise whatever the ratio (a small process)
    fd_slack: int = 16  # per service, end - start (connections come and go with load)
    consumer_slack: int = 4  # per stream, end - start
    work_slack: int = 0  # WORK messages left at the end, after the drain, over the start's


def tree_figures(pid: int) -> dict[str, float] | None:
    """RSS (MB, summed over the process and its descendants in its session), open fds and threads;
    None if gone. Not the training jobs and session workers the trainer's local launcher starts:
    each runs in a session of its own, and one running at a sample made the trainer 469 MB instead
    of 89."""
    try:
        import psutil
    except ImportError:
        return proc_figures(pid)
    try:
        root = psutil.Process(pid)
        session = os.getsid(pid)
        descendants = root.children(recursive=True)
    except (psutil.NoSuchProcess, ProcessLookupError):
        return None
    members = [root, *(c for c in descendants if same_session(c.pid, session))]
    rss = fds = threads = 0
    # Invariant: the sums hold every member looked at so far that still existed.
    for member in members:
        try:
            with member.oneshot():
                rss += member.memory_info().rss
                fds += member.num_fds()
                threads += member.num_threads()
        except psutil.NoSuchProcess:
            continue
    return {"rss_mb": rss / 2**20, "fds": fds, "threads": threads, "processes": len(members),
            "detached": len(descendants) + 1 - len(members)}


def same_session(pid: int, session: int) -> bool:
    try:
        return os.getsid(pid) == session
    except ProcessLookupError:
        return False


def proc_figures(pid: int) -> dict[str, float] | None:
    """The same from /proc, for the process alone (no psutil here)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "fds": fds,
            "threads": int(fields["Threads"]), "processes": 1, "detached": 0}


def live_local_runs(jobs_dir: Path) -> dict[str, int]:
    """Runs of the trainer's local launcher still running, training jobs and Tinker session workers
    apart: their records (``<jobs>/.local-runs``) whose process, by pid and start time, is alive
    (killing the trainer leaves them to init, so they are not in its process tree)."""
    workers_dir = jobs_dir / TINKER_DIR
    alive = {"jobs": 0, "tinker_workers": 0}
    runs_dir = jobs_dir / ".local-runs"
    # Invariant: alive counts the records read so far whose process is the one recorded.
    for record_file in sorted(runs_dir.glob("*.json")) if runs_dir.is_dir() else []:
        try:
            record = json.loads(record_file.read_text())
            if start_time(int(record["pid"])) == str(record["start"]):
                worker = Path(record["job_dir"]).is_relative_to(workers_dir)
                alive["tinker_workers" if worker else "jobs"] += 1
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return alive


def start_time(pid: int) -> str | None:
    """A live process's start time (field 22 of /proc/<pid>/stat), as the local launcher records it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]


def process_sample(stack: LocalStack) -> dict[str, dict]:
    """Every service process of ``stack`` by name (``nats``, ``gateway``, ``inference-r0``…)."""
    sample = {}
    for proc in stack.procs():
        figures = tree_figures(proc.pid)
        if figures is not None:
            sample[proc.name] = {"pid": proc.pid, **figures}
    return sample


async def nats_sample(nats_url: str, monitor_port: int | None) -> dict[str, Any]:
    """Each stream's messages, bytes and consumers, and the server's /varz figures."""
    nc = await nats.connect(nats_url, connect_timeout=5, max_reconnect_attempts=3, error_cb=quiet)
    try:
        streams = {}
        # Invariant: streams holds every stream listed before this one.
        for info in await nc.jetstream().streams_info():
            state = info.state
            streams[info.config.name] = {"messages": state.messages, "bytes": state.bytes,
                                         "consumers": state.consumer_count}
    finally:
        await nc.close()
    varz = await asyncio.to_thread(server_figures, monitor_port) if monitor_port else {}
    return {"streams": streams, "varz": varz}


def server_figures(monitor_port: int) -> dict[str, Any]:
    """nats-server's /varz figures (LocalStack starts it with its monitoring port on)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/varz", timeout=5) as resp:
            body = json.loads(resp.read())
    except OSError as error:
        return {"error": str(error)}
    return {name: body.get(name) for name in VARZ_FIELDS}


async def take_sample(stack: LocalStack, label: str, started: float) -> dict[str, Any]:
    return {"label": label, "t_s": round(time.monotonic() - started, 1),
            "processes": process_sample(stack),
            "local_runs": live_local_runs(stack.jobs_dir),
            **await nats_sample(stack.nats_url, stack.nats_monitor_port)}


def breaches(start: dict, end: dict, tallies: dict[str, dict], limits: Limits) -> list[str]:
    """Every invariant the run broke, each naming what: unanswered, rejected or duplicated requests,
    failed jobs, and whatever grew past its limit between ``start`` and ``end``."""
    found = []
    for kind, tally in tallies.items():
        for what in ("gave_up", "rejected", "duplicates", "failed_jobs"):
            if tally.get(what):
                found.append(f"{kind}: {tally[what]} {what.replace('_', ' ')}")
        if tally["started"] != tally["answered"] + tally["gave_up"] + tally["rejected"]:
            found.append(f"{kind}: {tally['started']} started, only {tally['answered']} answered and "
                         f"{tally['gave_up'] + tally['rejected']} given up or rejected")
    for name, first in start["processes"].items():
        last = end["processes"].get(name)
        if last is None:
            found.append(f"{name}: not running at the end")
            continue
        grown_mb = last["rss_mb"] - first["rss_mb"]
        if last["rss_mb"] > limits.rss_ratio * first["rss_mb"] and grown_mb > limits.rss_slack_mb:
            found.append(f"{name}: RSS {first['rss_mb']:.0f} -> {last['rss_mb']:.0f} MB "
                         f"(> x{limits.rss_ratio})")
        if last["fds"] > first["fds"] + limits.fd_slack:
            found.append(f"{name}: open fds {first['fds']} -> {last['fds']} (> +{limits.fd_slack})")
    if end["local_runs"]["jobs"]:
        found.append(f"{end['local_runs']['jobs']} training jobs still running after every job ended")
    for stream, last in end["streams"].items():
        first = start["streams"].get(stream, {"consumers": 0, "messages": 0})
        if last["consumers"] > first["consumers"] + limits.consumer_slack:
            found.append(f"stream {stream}: consumers {first['consumers']} -> {last['consumers']} "
                         f"(> +{limits.consumer_slack})")
        if stream == subjects.WORK_STREAM and last["messages"] > first["messages"] + limits.work_slack:
            found.append(f"stream WORK: {last['messages']} messages left after the drain")
    return found


def ratio(first: float, last: float) -> str:
    return f"{last / first:.2f}" if first else "-"


def table(start: dict, end: dict, restarts: dict[str, int]) -> str:
    """Per service: RSS and fds at start and end with their ratio, and the faults it took; per
    stream: messages, bytes and consumers; the server's figures."""
    lines = [f"{'service':<22}{'RSS MB start':>13}{'end':>8}{'ratio':>7}{'fds start':>11}{'end':>6}"
             f"{'ratio':>7}{'killed':>8}"]
    names = sorted(set(start["processes"]) | set(end["processes"]))
    for name in names:
        a, b = start["processes"].get(name), end["processes"].get(name)
        if a is None or b is None:
            lines.append(f"{name:<22}{'(missing at start or end)':>40}")
            continue
        lines.append(f"{name:<22}{a['rss_mb']:>13.0f}{b['rss_mb']:>8.0f}{ratio(a['rss_mb'], b['rss_mb']):>7}"
                     f"{a['fds']:>11}{b['fds']:>6}{ratio(a['fds'], b['fds']):>7}{restarts.get(name, 0):>8}")
    lines.append("")
    lines.append(f"{'stream':<22}{'msgs start':>11}{'end':>9}{'bytes start':>13}{'end':>11}"
                 f"{'consumers start':>17}{'end':>5}")
    for stream in sorted(set(start["streams"]) | set(end["streams"])):
        a = start["streams"].get(stream, {"messages": 0, "bytes": 0, "consumers": 0})
        b = end["streams"].get(stream, {"messages": 0, "bytes": 0, "consumers": 0})
        lines.append(f"{stream:<22}{a['messages']:>11}{b['messages']:>9}{a['bytes']:>13}{b['bytes']:>11}"
                     f"{a['consumers']:>17}{b['consumers']:>5}")
    if start.get("varz") and end.get("varz"):
        lines.append("")
        lines.append("nats-server /varz: " + ", ".join(
            f"{k} {start['varz'].get(k)} -> {end['varz'].get(k)}" for k in VARZ_FIELDS))
    return "\n".join(lines)
