"""The checkpoint-watcher's /metrics, scraped from the real process: checkpoints by outcome
(announced, skipped for a newer one, rejected) and the latency from written to announced."""

from __future__ import annotations

import hashlib

from loopline.common.contracts import subjects
from loopline.common.contracts.adapter_format import WEIGHTS_FILE
from support.scrape import metrics_url, scrape, value

JOB = hashlib.sha256(b"metrics").hexdigest()


async def test_checkpoints_by_outcome_and_publish_latency(start_watcher, jobs, heard):
    # Two checkpoints already there when the watcher starts: the newest is announced, the older
    # one skipped.
    jobs.job(JOB)
    jobs.checkpoint(JOB, 1)
    jobs.checkpoint(JOB, 2)
    await start_watcher()
    await heard.until(lambda: heard.steps(JOB) == [2])
    # Then one without its weights: rejected.
    broken = jobs.staged(JOB, 3)
    (broken / WEIGHTS_FILE).unlink()
    jobs.publish(broken)
    await heard.until(lambda: heard.rejected)

    samples = scrape(await metrics_url(heard.nc, subjects.SVC_CHECKPOINT_WATCHER_STATUS))
    outcomes = {outcome: value(samples, "loopline_checkpoints_total", outcome=outcome)
                for outcome in ("announced", "skipped", "rejected")}
    assert outcomes == {"announced": 1, "skipped": 1, "rejected": 1}
    assert value(samples, "loopline_checkpoint_publish_seconds_count") == 1
    latency = value(samples, "loopline_checkpoint_publish_seconds_sum")
    announced = heard.announced[0][2]
    assert latency == announced.announced_at - announced.created_at
