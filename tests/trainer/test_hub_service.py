"""push_to_hub through the real trainer process (local launcher, stand-in program), against
tests/support/fake_hub.py: a COMPLETED job lands on the Hub and its info and events say so; a trainer
with no token refuses the job at submission; a Hub that refuses the token leaves the job COMPLETED
with the reason; a namespace or a public repo the operator did not allow is refused at submission;
the job that is pushed never sees the token, in its environment or its files."""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from loopline.common.contracts import adapter_format
from loopline.common.contracts.job_layout import CHECKPOINTS_DIR, checkpoint_name
from loopline.common.contracts.job_schemas import JobInfo
from loopline.common.runtime.service_client import ServiceError
from loopline.trainer.jobdir import control_dir
from support.fake_hub import FakeHub
from support.trainer import TrainerClient
from support.trainer_process import STANDIN

TOKEN = "hf_trainer_token"
# The training command of the token test: the job's process writes its environment, as the kernel
# handed it over, into its job directory, then runs the stand-in ($0 python, $1 $2 "--job-dir DIR").
SEEN_ENV = "seen-env.txt"
PROBE = ("/bin/bash -c " + shlex.quote(f'tr "\\0" "\\n" < /proc/$$/environ > "$2/{SEEN_ENV}"; '
                                       f'exec "$0" {shlex.quote(str(STANDIN))} "$@"')
         + f" {shlex.quote(sys.executable)}")


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
    await start_trainer("local", hub_endpoint=hub.url, hub_token_file=token_file,
                        hub_allowed_namespaces="tester")
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
    await start_trainer("local", hub_endpoint=hub.url, hub_token_file=token_file,
                        hub_allowed_namespaces="tester")
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


async def refusal(client: TrainerClient, params: dict, **submit: object) -> ServiceError:
    with pytest.raises(ServiceError) as refused:
        await client.submit(params, **submit)
    return refused.value


async def test_a_namespace_or_a_public_repo_the_operator_did_not_allow_is_refused_at_submission(
        start_trainer, client, jobs_dir, hub, tmp_path):
    token_file = tmp_path / "hf-token"
    token_file.write_text(TOKEN)
    await start_trainer("local", hub_endpoint=hub.url, hub_token_file=token_file,
                        hub_allowed_namespaces="Tenants")
    # Queued, never trained: what is tested is the submission.
    loading = {"max_steps": 1, "standin_start_s": 120}

    theirs = await refusal(client, {**loading, "push_to_hub": {"repo_id": "operator-org/prod"}})
    assert theirs.status == 422 and "LOOPLINE_HUB_ALLOWED_NAMESPACES" in theirs.message, theirs
    assert "params.push_to_hub.repo_id" in theirs.message and "admin" in theirs.message
    # A public repo needs the operator's word, whoever asks.
    wide_open = {"repo_id": "operator-org/p", "private": False}
    public = await refusal(client, {**loading, "push_to_hub": wide_open}, admin=True)
    assert public.status == 422 and "LOOPLINE_HUB_ALLOW_PUBLIC" in public.message, public
    assert not jobs_dir.exists() or [p.name for p in jobs_dir.iterdir() if not p.name.startswith(".")] == []

    listed = await client.submit({**loading, "push_to_hub": {"repo_id": "tenants/mine"}})  # any case
    admin = await client.submit({**loading, "push_to_hub": {"repo_id": "operator-org/prod"}}, admin=True)
    assert {listed.status.value, admin.status.value} == {"QUEUED"}
    assert hub.calls == []  # nothing is asked of the Hub before a job completes


def files_holding(folder: Path, secrets: tuple[str, ...]) -> list[str]:
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            content = (Path(root) / name).read_bytes()
            found += [f"{root}/{name}: {s}" for s in secrets if s.encode() in content]
    return found


async def test_the_job_that_is_pushed_never_sees_the_token(start_trainer, client, jobs_dir, hub, tmp_path,
                                                            monkeypatch):
    token_file = tmp_path / "secrets" / "hf-token"
    token_file.parent.mkdir()
    token_file.write_text(TOKEN)
    monkeypatch.setenv("HF_TOKEN", "hf_env_token")  # huggingface_hub's own variable, set beside the file
    await start_trainer("local", hub_endpoint=hub.url, hub_token_file=token_file, train_command=PROBE,
                        hub_allowed_namespaces="tester")
    info = await client.submit({"max_steps": 2, "push_to_hub": {"repo_id": "tester/unseen"}})
    done = await pushed(client, info.job_hash)
    assert done.hub.status == "pushed", done.hub  # the trainer had the token, and used it

    job_dir = jobs_dir / info.job_hash
    lines = (job_dir / SEEN_ENV).read_text().splitlines()
    env = dict(line.split("=", 1) for line in lines if "=" in line)
    assert env["LOOPLINE_JOB_DIR"] == str(job_dir)  # it is the job's own environment
    assert "HF_TOKEN" not in env and "LOOPLINE_HUB_TOKEN_FILE" not in env
    secrets = (TOKEN, "hf_env_token", str(token_file))
    assert not [s for s in secrets if any(s in value for value in env.values())]
    # Nor in anything the job was given or wrote: its config, entrypoint, logs, events.
    assert files_holding(job_dir, secrets) == [] and files_holding(control_dir(job_dir), secrets) == []
