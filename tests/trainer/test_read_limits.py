"""What a job's code writes is read by the trainer with a bound (issue: no tenant can hurt another):
a status.json or an events.jsonl line over its limit fails that job with the reason, a log line over
its limit is cut, a job's history comes in pages; the trainer's peak RSS stays within RSS_BOUND
while a job holds 64 GiB (sparse: no disk) of one line, and it goes on serving the other jobs.

The trainer is its own process (the local launcher, the stand-in program); the test writes the
job's files as the job's own code could. Unbounded, each of these read the whole 64 GiB: the first
read of a status.json ended in MemoryError at every reconcile pass (the job never failed), a
readline() of the events or the log grew until the machine ran out of memory.
"""

from __future__ import annotations

import json
import os

import pytest

from loopline.common.contracts import subjects
from loopline.common.contracts.job_layout import EVENTS_FILE, STATUS_FILE
from loopline.common.contracts.job_schemas import JobInfo, JobList, LogLines
from loopline.common.runtime.service_client import ServiceError
from loopline.trainer.jobdir import log_path
from support.peak_rss import PeakRss

MiB = 1024 * 1024
GiB = 1024 * MiB
# What a refused 64 GiB may add to the trainer's peak RSS: the limit's worth of it (1 MiB at
# most) and the requests' own objects.
RSS_BOUND = 40 * MiB
# A job "loading its model" this long: its run is alive, it writes nothing, and it stops at once.
LOADING = {"max_steps": 2, "standin_start_s": 120}


def sparse_append(path, size: int, then: bytes = b"") -> None:
    """``size`` zero bytes with no newline (a hole: no disk) at the end of ``path``, then ``then``."""
    with open(path, "ab") as f:
        f.truncate(f.seek(0, os.SEEK_END) + size)
        f.seek(0, os.SEEK_END)
        f.write(then)


async def fails_and_others_go_on(client, job_hash: str, setting: str) -> JobInfo:
    """The job ends FAILED naming ``setting``, its last event says so, and a new job completes."""
    failed = await client.wait_status(job_hash, "FAILED")
    assert setting in failed.error, failed.error
    # The event follows the status (the reconcile loop publishes it): wait for it, then it is the
    # last one the job has.
    events = await client.events(job_hash, until="failed")
    assert setting in events[-1].error
    assert [e.kind for e in await client.events(job_hash)][-1] == "failed"
    other = await client.submit({"max_steps": 2})
    assert (await client.wait_status(other.job_hash, "COMPLETED")).step == 2
    return failed


async def test_a_status_over_its_limit_fails_the_job_and_the_trainer_goes_on(start_trainer, client, jobs_dir):
    trainer = await start_trainer("local")
    bad = await client.submit(LOADING)
    with PeakRss(trainer.pid) as rss:
        sparse_append(jobs_dir / bad.job_hash / STATUS_FILE, 64 * GiB)
        await fails_and_others_go_on(client, bad.job_hash, "LOOPLINE_MAX_STATUS_BYTES")
    assert rss.growth < RSS_BOUND, rss.growth
    assert trainer.alive()


async def test_an_events_line_over_its_limit_fails_the_job_and_the_trainer_goes_on(start_trainer, client,
                                                                                  jobs_dir):
    trainer = await start_trainer("local")
    bad = await client.submit(LOADING)
    with PeakRss(trainer.pid) as rss:
        sparse_append(jobs_dir / bad.job_hash / EVENTS_FILE, 64 * GiB)  # one line, never ended
        await fails_and_others_go_on(client, bad.job_hash, "LOOPLINE_MAX_EVENT_LINE_BYTES")
        # A restart counts the old lines (passing over the long one) and runs the job again.
        restarted = await client.job(subjects.SVC_TRAINER_RESTART, bad.job_hash)
    assert restarted.status.value == "QUEUED"
    assert rss.growth < RSS_BOUND, rss.growth
    assert trainer.alive()


async def test_a_log_line_over_its_limit_is_cut_and_the_log_comes_in_pages(start_trainer, client, jobs_dir):
    trainer = await start_trainer("local", max_log_page_bytes=256 * 1024)
    job = await client.submit({"max_steps": 2, "standin_start_s": 1})
    log = log_path(jobs_dir / job.job_hash, "local", job.slurm_job_id)
    long_lines = b"".join(b"%d " % i + b"y" * 60_000 + b"\n" for i in range(12))
    with PeakRss(trainer.pid) as rss:
        sparse_append(log, 64 * GiB, b" end of the long line\n" + long_lines)
        # The log is only shown: the job itself goes on.
        assert (await client.wait_status(job.job_hash, "COMPLETED")).step == 2
        pages: list[LogLines] = []
        while not pages or pages[-1].more:
            start = pages[-1].lines[-1].line_number + 1 if pages else 0
            raw = await client.service.request(subjects.SVC_TRAINER_LOGS, {"job": job.job_hash,
                                                                            "starting_line_number": start})
            assert len(raw) < 512 * 1024  # well under NATS's max_payload (1 MiB)
            pages.append(LogLines.model_validate_json(raw))
    assert rss.growth < RSS_BOUND, rss.growth
    lines = [line.line for page in pages for line in page.lines]
    assert [line.line_number for page in pages for line in page.lines] == list(range(len(lines)))
    cut = next(i for i, line in enumerate(lines) if "line cut" in line)
    assert lines[cut].endswith(f"[... line cut: {64 * GiB + 21} bytes, the log shows 65536 "
                               f"(LOOPLINE_MAX_LOG_LINE_BYTES)]"), lines[cut][-200:]
    assert [line.split(" ")[0] for line in lines[cut + 1:cut + 13]] == [str(i) for i in range(12)]
    assert lines[-1] == "standin: completed"
    assert len(pages) >= 3  # 12 lines of 60 KB: a few to each page of 256 KiB


async def test_a_jobs_history_comes_in_pages_and_a_list_carries_its_newest_points(start_trainer, client,
                                                                                 jobs_dir):
    await start_trainer("local")
    job = await client.submit({"max_steps": 2})
    await client.wait_status(job.job_hash, "COMPLETED")
    # As many points as fit LOOPLINE_MAX_STATUS_BYTES (1 MiB): unpaged, 2 MB of JSON in one reply,
    # over NATS's max_payload, so no reply at all.
    points = [{"step": i, "loss": 1} for i in range(40_000)]
    status = json.dumps({"status": "COMPLETED", "history": points}, separators=(",", ":"))
    assert len(status) < MiB
    (jobs_dir / job.job_hash / STATUS_FILE).write_text(status)

    raw = await client.service.request(subjects.SVC_TRAINER_GET, {"job": job.job_hash})
    newest = JobInfo.model_validate_json(raw)
    assert len(raw) < 256 * 1024
    assert (newest.history_total, newest.history_offset, len(newest.history)) == (40_000, 40_000 - 1024, 1024)
    assert newest.history[-1].step == 39_999
    first = JobInfo.model_validate(await client.call(subjects.SVC_TRAINER_GET, {
        "job": job.job_hash, "history_offset": 0, "history_limit": 10}))
    assert [p.step for p in first.history] == list(range(10)) and first.history_offset == 0
    with pytest.raises(ServiceError) as caught:
        await client.call(subjects.SVC_TRAINER_GET, {"job": job.job_hash, "history_limit": 1025})
    assert caught.value.status == 422 and "LOOPLINE_MAX_HISTORY_POINTS" in str(caught.value)
    listed = JobList.model_validate(await client.call(subjects.SVC_TRAINER_LIST))
    assert [p.step for p in listed.jobs[0].history] == list(range(40_000 - 100, 40_000))
