"""`make test`'s machine watch (tests/support/lane_watch.py) reads this machine's /proc as it is."""

from __future__ import annotations

import os
import time

from support.lane_watch import CPU_FIELDS, MachineWatch, biggest_processes, cpu_times, mem_available_gb


def test_cpu_time_grows_with_work_done():
    before = cpu_times()
    assert set(before) == set(CPU_FIELDS)
    end = time.process_time() + 0.3
    while time.process_time() < end:  # 0.3 s of this process's CPU, at least 30 ticks at 100 Hz
        pass
    after = cpu_times()
    assert after["user"] + after["system"] - before["user"] - before["system"] >= 20


def test_the_largest_processes_are_read_with_their_commands():
    ballast = bytearray(400 * 2**20)  # 400 MB resident: this process is among the largest
    ballast[:: 4096] = b"x" * len(ballast[:: 4096])
    found = biggest_processes(count=50)
    assert found == sorted(found, reverse=True)
    mine = [(gb, cmd) for gb, pid, cmd in found if pid == os.getpid()]
    assert mine and mine[0][0] >= 0.39 and "python" in mine[0][1], found[:5]
    assert 0 < mem_available_gb() < os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30


def test_a_watch_samples_until_stopped_and_sums_the_run_up(tmp_path):
    watch = MachineWatch(tmp_path / "machine.log", every_s=0.05)
    watch.start()
    time.sleep(0.5)
    watch.stop()
    assert not watch.is_alive()
    logged = (tmp_path / "machine.log").read_text().splitlines()
    assert len(logged) == len(watch.samples) >= 3
    assert all(" load " in line and " available " in line for line in logged)
    summary = "\n".join(watch.summary())
    for part in ("CPU over", "steal", "load mean", "memory available min", str(tmp_path / "machine.log")):
        assert part in summary, summary
