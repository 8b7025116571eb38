"""A process's peak resident memory over a stretch of a test: the kernel's high-water mark
(``VmHWM``), reset at the start (``clear_refs``), next to psutil's current RSS at the end."""

from __future__ import annotations

from pathlib import Path

import psutil


class PeakRss:
    def __init__(self, pid: int):
        self.pid = pid
        self.proc = psutil.Process(pid)
        self.before = self.peak = self.after = 0

    def __enter__(self) -> PeakRss:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # the high-water mark := the RSS now
        self.before = self.proc.memory_info().rss
        return self

    def __exit__(self, *_exc) -> None:
        status = Path(f"/proc/{self.pid}/status").read_text()
        self.peak = int(next(line.split()[1] for line in status.splitlines()
                             if line.startswith("VmHWM:"))) * 1024
        self.after = self.proc.memory_info().rss

    @property
    def growth(self) -> int:
        """What the stretch added to the process's resident memory at its highest."""
        return max(self.peak, self.after) - self.before
