"""What the machine did while `make test`'s lanes ran (scripts/test_lanes.py), printed as its last
lines, so that a slow CI run says why: CI keeps only the tail of what a run printed.

Stop 40's CI run took over 5,130 s for lanes that take ~2,200 s on an idle machine of the same kind,
both lanes alike, and its tail named no cause. A sample every ``every_s`` records the CPU split
(steal and iowait tell a busy host or a thrashing disk from our own work), the load, the memory
available and the processes holding the most of it (a leaked engine holds 1-2 GB), into a log.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times() -> dict[str, int]:
    """The machine's CPU time so far, in clock ticks, by kind (/proc/stat's first line)."""
    values = Path("/proc/stat").read_text().splitlines()[0].split()[1:1 + len(CPU_FIELDS)]
    return dict(zip(CPU_FIELDS, map(int, values), strict=True))


def mem_available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def biggest_processes(count: int = 3) -> list[tuple[float, int, str]]:
    """(resident GB, pid, command line's start) of the ``count`` processes holding the most memory."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            rss_pages = int((entry / "statm").read_text().split()[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue  # gone between the listing and the read
        found.append((rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**30, int(entry.name), command[:90].strip()))
    return sorted(found, reverse=True)[:count]


@dataclass
class Sample:
    at_s: float
    load: float
    available_gb: float
    processes: int
    biggest: list[tuple[float, int, str]] = field(default_factory=list)


class MachineWatch(threading.Thread):
    """Samples the machine until ``stop``; ``summary`` is a few lines about the whole run."""

    def __init__(self, log: Path, every_s: float = 15.0) -> None:
        super().__init__(name="machine-watch", daemon=True)
        self.log, self.every_s = log, every_s
        self.samples: list[Sample] = []
        self._stopped = threading.Event()
        self._began = time.monotonic()
        self._cpu_start = cpu_times()

    def run(self) -> None:
        with open(self.log, "w") as out:
            # Invariant: every sample taken is in ``samples`` and on a line of the log.
            while not self._stopped.wait(self.every_s):
                sample = Sample(time.monotonic() - self._began, os.getloadavg()[0], mem_available_gb(),
                                sum(1 for p in Path("/proc").iterdir() if p.name.isdigit()),
                                biggest_processes())
                self.samples.append(sample)
                top = "; ".join(f"{gb:.1f} GB {pid} {cmd}" for gb, pid, cmd in sample.biggest)
                out.write(f"{sample.at_s:6.0f} s load {sample.load:5.2f} available "
                          f"{sample.available_gb:5.1f} GB processes {sample.processes:4d} | {top}\n")
                out.flush()

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=5)

    def summary(self) -> list[str]:
        ticks = {kind: now - self._cpu_start[kind] for kind, now in cpu_times().items()}
        total = sum(ticks.values()) or 1
        split = ", ".join(f"{kind} {100 * ticks[kind] / total:.1f}%"
                          for kind in ("user", "system", "idle", "iowait", "steal"))
        lines = [f"CPU over {time.monotonic() - self._began:.0f} s on {os.cpu_count()} cores: {split}"]
        if self.samples:
            busiest = max(self.samples, key=lambda s: s.load)
            tightest = min(self.samples, key=lambda s: s.available_gb)
            crowded = max(self.samples, key=lambda s: s.processes)
            mean_load = sum(s.load for s in self.samples) / len(self.samples)
            lines.append(f"load mean {mean_load:.2f}, max {busiest.load:.2f} at {busiest.at_s:.0f} s; "
                         f"processes max {crowded.processes} at {crowded.at_s:.0f} s")
            top = "; ".join(f"{gb:.1f} GB {cmd[:60]}" for gb, _, cmd in tightest.biggest)
            lines.append(f"memory available min {tightest.available_gb:.1f} GB at {tightest.at_s:.0f} s "
                         f"(largest then: {top})")
        lines.append(f"every {self.every_s:g} s: {self.log}")
        return lines
