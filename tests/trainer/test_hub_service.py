"""push_to_hub through the real trainer process (local launcher, stand-in program), against
tests/support/fake_hub.py: a COMPLETED job lands on the Hub and its info and events say so; a trainer
with no token refuses the job at submission; a Hub that refuses the token leaves the job COMPLETED
with the reason."""

from __future__ import annotations

import asyncio
import time

import pytest

from loopline.common.contracts import adapter_format
from loopline.common.contracts.job_layout import CHECKPOINTS_DIR, checkpoint_name
from loopline.common.contracts.job_schemas import JobInfo
from loopline.common.runtime.service_client import ServiceError
from support.fake_hub import FakeHub
from support.trainer import TrainerClient

TOKEN = "hf_trainer_token"


@pytest.fixture
def hub():
    with FakeHub(tokens={TOKEN}) as running:
        yield running


async def pushed(client: TrainerClient, job_hash: str, timeout_s: float = 60.0) -> JobInfo:
    """The job once its push is no longer pending."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = await client.get(job_hash)
        if info.hub is not None and info.hub.status != "pending":
            return info
        assert time.monotonic() < deadline, f"push of {job_hash} still pending: {info.hub}"
        await asyncio.sleep(0.1)


async def test_a_completed_job_is_pushed_and_says_so(start_trainer, client, jobs_dir, hub, tmp_path):
    token_file = tmp_path / "hf-token"
    token_file.write_text(TOKEN)
    await start_trainer("local", hub_endpoint=hub.url, hub_token_file=token_file)
    params = {"max_steps": 3, "push_to_hub": {"repo_id": "tester/standin", "revision": "run-1"}}
    info = await client.submit(params)
    assert info.hub is None  # nothing to say before the job completes
    await client.wait_status(info.job_hash, "COMPLETED")

    done = await pushed(client, info.job_hash)
    assert done.status.value == "COMPLETED"
    assert done.hub.status == "pushed", done.hub
    assert (done.hub.repo_id, done.hub.revision) == ("tester/standin", "run-1")
    assert done.hub.url == f"{hub.url}/tester/standin/commit/{done.hub.commit}"
    files = hub.files("tester/standin", "run-1")
    checkpoint = jobs_dir / info.job_hash / CHECKPOINTS_DIR / checkpoint_name(3)
    weights = adapter_format.WEIGHTS_FILE
    assert files[weights] == (checkpoint / weights).read_bytes()
    assert info.job_hash in files["README.md"].decode()

    events = await client.events(info.job_hash, until="hub")
    assert [e.kind for e in events][-2:] == ["completed", "hub"]
    assert events[-1].hub == done.hub and events[-1].status.value == "COMPLETED"


async def test_no_token_refuses_at_submission_and_a_refused_token_leaves_the_job_completed(
        start_trainer, client, hub, tmp_path):
    token_file = tmp_path / "hf-token"  # a Secret not mounted yet: the trainer reads it when it needs it
    await start_trainer("local", hub_endpoint=hub.url, hub_token_file=token_file)
    params = {"max_steps": 2, "push_to_hub": {"repo_id": "tester/refused"}}
    with pytest.raises(ServiceError) as refused:
        await client.submit(params)
    assert refused.value.status == 422 and "push_to_hub" in str(refused.value), refused.value

    token_file.write_text("hf_revoked")  # mounted now, with a token the Hub does not take
    info = await client.submit(params)
    done = await pushed(client, info.job_hash)
    assert done.status.value == "COMPLETED" and done.error is None
    assert done.hub.status == "failed" and "401" in done.hub.error, done.hub
    assert "hf_revoked" not in done.hub.error
    assert "tester/refused" not in hub.repos
    event = (await client.events(info.job_hash, until="hub"))[-1]
    assert event.hub.status == "failed" and event.hub.error == done.hub.error
