"""The trainer's /metrics, scraped from the real process (local launcher, the stand-in training
program): its registry's jobs by status, every status present, read when scraped."""

from __future__ import annotations

from loopline.common.contracts import subjects
from support.scrape import metrics_url, scrape, value


def jobs_by_status(url: str) -> dict[str, float | None]:
    samples = scrape(url)
    return {status: value(samples, "loopline_trainer_jobs", status=status)
            for status in ("QUEUED", "TRAINING", "COMPLETED", "FAILED", "CANCELLED")}


async def test_jobs_by_status(start_trainer, client, nc):
    await start_trainer("local")
    url = await metrics_url(nc, subjects.SVC_TRAINER_STATUS)
    assert jobs_by_status(url) == {"QUEUED": 0, "TRAINING": 0, "COMPLETED": 0, "FAILED": 0, "CANCELLED": 0}

    done = await client.submit({"max_steps": 2})
    await client.wait_status(done.job_hash, "COMPLETED")
    failed = await client.submit({"max_steps": 2, "standin_fail": "ValueError: on purpose"})
    await client.wait_status(failed.job_hash, "FAILED")
    assert jobs_by_status(url) == {"QUEUED": 0, "TRAINING": 0, "COMPLETED": 1, "FAILED": 1, "CANCELLED": 0}
    assert value(scrape(url), "loopline_service_info", role="trainer") == 1
