"""The trainer service as a real process, over real Slurm and over the local launcher: a job's life
from submit to delete, its events, cancel and restart, and the refusals."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import sqlite3
import tarfile

import pytest

from loopline.common.contracts import subjects
from loopline.common.contracts.job_layout import (
    CHECKPOINTS_DIR,
    DATASET_FILE,
    ENTRYPOINT_FILE,
    EVENTS_FILE,
    checkpoint_name,
)
from loopline.common.contracts.job_schemas import ClusterInfo, JobList, JobSubmit, LogLines, SqueueReply
from loopline.common.local import launcher as processes
from loopline.common.runtime.service_client import ServiceError
from loopline.trainer.jobdir import control_dir
from support.trainer import DATASET
from support.trainer_process import local_launcher


async def test_a_job_runs_and_its_events_arrive_in_order(launcher_kind, start_trainer, client, jobs_dir):
    await start_trainer(launcher_kind)
    params = {"max_steps": 4, "steps_per_checkpoint": 2, "adapter_type": "lora"}
    info = await client.submit(params)
    assert info.status.value == "QUEUED"
    assert info.llm_name == "tiny" and info.params.llm_name == "tiny"
    assert info.slurm_job_id
    job_dir = jobs_dir / info.job_hash
    assert (job_dir / DATASET_FILE).read_bytes().startswith(b'{"input": "What is 2+2?"')

    events = await client.events(info.job_hash, until="completed")
    kinds = [e.kind for e in events]
    assert kinds == ["queued", "started", "progress", "progress", "checkpoint", "progress", "progress",
                     "checkpoint", "completed"], kinds
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[-2].checkpoint.path == f"{CHECKPOINTS_DIR}/{checkpoint_name(4)}"
    assert events[2].loss == pytest.approx(0.5) and events[2].status.value == "TRAINING"

    done = await client.wait_status(info.job_hash, "COMPLETED")
    assert done.step == 4 and done.max_steps == 4
    assert [p.step for p in done.history] == [1, 2, 3, 4]
    assert [c.step for c in done.checkpoints] == [2, 4]
    assert done.started_at and done.finished_at and done.error is None

    # A subscriber that comes after the job ended still gets its whole history, once.
    late = await client.events(info.job_hash)
    assert [(e.seq, e.kind) for e in late] == [(e.seq, e.kind) for e in events]

    # The same submit again is the same job: no second sbatch.
    again = await client.submit(params)
    assert again.job_hash == info.job_hash and again.slurm_job_id == info.slurm_job_id
    assert again.status.value == "COMPLETED"
    assert (job_dir / "runs.txt").read_text().count("start") == 1

    logs = LogLines.model_validate(await client.call(subjects.SVC_TRAINER_LOGS,
                                                     {"job": info.job_hash[:10], "starting_line_number": 0}))
    assert logs.finished and any("standin: completed" in line.line for line in logs.lines)
    assert [line.line_number for line in logs.lines] == list(range(len(logs.lines)))
    tail = LogLines.model_validate(await client.call(subjects.SVC_TRAINER_LOGS,
                                                     {"job": "latest", "starting_line_number": 1}))
    assert [line.line for line in tail.lines] == [line.line for line in logs.lines[1:]]

    with pytest.raises(ServiceError) as refused:
        await client.job(subjects.SVC_TRAINER_RESTART, info.job_hash)
    assert refused.value.status == 409

    deleted = await client.job(subjects.SVC_TRAINER_DELETE, info.job_hash)
    assert deleted.job_hash == info.job_hash
    assert not job_dir.exists()
    with pytest.raises(ServiceError) as refused:
        await client.get(info.job_hash)
    assert refused.value.status == 404
    assert await client.events(info.job_hash) == []


async def test_cancel_stops_the_run_and_restart_resumes_it(launcher_kind, start_trainer, client, jobs_dir,
                                                           request):
    await start_trainer(launcher_kind)
    info = await client.submit({"max_steps": 40, "steps_per_checkpoint": 100, "standin_step_s": 0.1})
    await client.events(info.job_hash, until="progress")

    cancelled = await client.job(subjects.SVC_TRAINER_CANCEL, info.job_hash[:12])
    assert cancelled.status.value == "CANCELLED" and cancelled.finished_at
    events = await client.events(info.job_hash, until="cancelled")
    assert events[-1].status.value == "CANCELLED"
    if launcher_kind == "slurm":
        slurm = request.getfixturevalue("slurm")
        out = slurm.run("squeue", "-h", "-t", "all", "-j", info.slurm_job_id, "-o", "%T").stdout
        assert out.strip() in ("CANCELLED", "COMPLETING"), out
    # Cancelling again is a no-op; the job stays cancelled while the reconcile loop runs.
    again = await client.job(subjects.SVC_TRAINER_CANCEL, info.job_hash)
    assert again.status.value == "CANCELLED"

    # The run checkpointed on SIGTERM; a restart resumes from there in a new run.
    restarted = await client.job(subjects.SVC_TRAINER_RESTART, info.job_hash)
    assert restarted.status.value == "QUEUED"
    assert restarted.slurm_job_id and restarted.slurm_job_id != info.slurm_job_id
    await client.wait_status(info.job_hash, "COMPLETED")
    runs = (jobs_dir / info.job_hash / "runs.txt").read_text().splitlines()
    assert len(runs) == 2 and runs[0] == "start 0 rank 0/1" and runs[1] != runs[0], runs

    events = await client.events(info.job_hash)
    kinds = [e.kind for e in events]
    cut = kinds.index("cancelled")
    assert kinds[cut + 1:cut + 3] == ["queued", "started"] and kinds[-1] == "completed", kinds
    assert events[cut + 2].step > 0  # started again from the checkpoint, not from 0
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs))


async def test_a_run_killed_behind_the_trainers_back_is_resubmitted_and_resumes(
        launcher_kind, start_trainer, client, jobs_dir, request):
    await start_trainer(launcher_kind)
    info = await client.submit({"max_steps": 30, "steps_per_checkpoint": 100, "standin_step_s": 0.1})
    await client.events(info.job_hash, until="progress")

    # What preemption, a time limit or an admin's scancel does: SIGTERM, the program checkpoints
    # and exits with status.json still TRAINING.
    if launcher_kind == "slurm":
        request.getfixturevalue("slurm").run("scancel", info.slurm_job_id)
    else:
        runs_dir = local_launcher(jobs_dir).runs_dir  # where the trainer's local launcher keeps its records
        record = json.loads((runs_dir / f"{info.slurm_job_id}.json").read_text())
        os.killpg(record["pid"], signal.SIGTERM)

    done = await client.wait_status(info.job_hash, "COMPLETED", timeout_s=90)
    assert done.slurm_job_id != info.slurm_job_id
    runs = (jobs_dir / info.job_hash / "runs.txt").read_text().splitlines()
    assert len(runs) == 2 and int(runs[1].split()[1]) > 0, runs
    kinds = [e.kind for e in await client.events(info.job_hash)]
    assert kinds.count("started") == 2 and kinds.count("completed") == 1 and "cancelled" not in kinds


async def test_a_restarted_trainer_neither_repeats_nor_misses_events(launcher_kind, start_trainer, client,
                                                                    jobs_dir):
    first = await start_trainer(launcher_kind)
    info = await client.submit({"max_steps": 25, "steps_per_checkpoint": 5, "standin_step_s": 0.1})
    await client.events(info.job_hash, until="progress")
    processes.kill(first)  # no goodbye: kill -9 in the middle of whatever it was doing
    # The run goes on without a trainer; its events wait in events.jsonl.
    job_dir = jobs_dir / info.job_hash
    lines_then = (job_dir / EVENTS_FILE).read_text().count("\n")
    await asyncio.sleep(1.0)
    assert (job_dir / EVENTS_FILE).read_text().count("\n") > lines_then

    await start_trainer(launcher_kind)
    await client.wait_status(info.job_hash, "COMPLETED", timeout_s=90)
    events = await client.events(info.job_hash)
    lines = (job_dir / EVENTS_FILE).read_text().splitlines()
    assert [e.seq for e in events] == list(range(1, len(lines) + 1))
    assert [e.kind for e in events] == [json.loads(line)["kind"] for line in lines]
    assert (job_dir / "runs.txt").read_text().count("start") == 1  # the run was never disturbed


async def test_a_failing_program_fails_the_job_and_restart_runs_it_again(launcher_kind, start_trainer,
                                                                         client):
    await start_trainer(launcher_kind)
    info = await client.submit({"max_steps": 3, "standin_fail": "ValueError: the loss is a fish"})
    failed = await client.wait_status(info.job_hash, "FAILED")
    assert failed.error == "ValueError: the loss is a fish" and failed.finished_at
    events = await client.events(info.job_hash)
    assert [e.kind for e in events] == ["queued", "failed"]
    assert events[-1].error == "ValueError: the loss is a fish"

    restarted = await client.job(subjects.SVC_TRAINER_RESTART, info.job_hash)
    assert restarted.status.value == "QUEUED" and restarted.error is None
    await client.wait_status(info.job_hash, "FAILED")
    kinds = [e.kind for e in await client.events(info.job_hash)]
    assert kinds == ["queued", "failed", "queued", "failed"]


async def test_a_run_that_keeps_dying_without_progress_fails_the_job(start_trainer, client):
    await start_trainer("local", max_resubmits=1)
    info = await client.submit({"max_steps": 3, "standin_crash": True})
    failed = await client.wait_status(info.job_hash, "FAILED")
    assert "2 times in a row without progress" in failed.error
    assert "crashing on purpose" in failed.error  # the end of its log says why
    events = await client.events(info.job_hash)
    assert [e.kind for e in events] == ["queued", "failed"]


async def test_requests_that_are_refused(start_trainer, client, jobs_dir):
    await start_trainer("local")

    async def refused(subject: str, body) -> int:
        with pytest.raises(ServiceError) as caught:
            await client.call(subject, body)
        return caught.value.status

    assert await refused(subjects.SVC_TRAINER_GET, {"job": "0123abcd"}) == 404
    assert await refused(subjects.SVC_TRAINER_GET, {"job": "latest"}) == 404
    assert await refused(subjects.SVC_TRAINER_CANCEL, {"job": "nope"}) == 404
    assert await refused(subjects.SVC_TRAINER_GET, {"nojob": 1}) == 422
    for params in ({"tensor_parallel": "two"}, {"adapter_type": "dora"}, {"timeout": -1}, {"max_steps": 0}):
        with pytest.raises(ServiceError) as caught:
            await client.submit(params)
        assert caught.value.status == 422, params
    dataset = await client.put(DATASET)
    first, second = "abc1" + "0" * 60, "abc2" + "0" * 60
    bad_hash = {"job_hash": "../../etc", "params": {}, "dataset_sha256": dataset, "dataset_bytes": 1,
                "examples": 1}
    assert await refused(subjects.SVC_TRAINER_SUBMIT, bad_hash) == 422
    missing = JobSubmit(job_hash=first, params={}, dataset_sha256="0" * 64, dataset_bytes=1, examples=1)
    assert await refused(subjects.SVC_TRAINER_SUBMIT, missing) == 422
    assert not (jobs_dir / first).exists()

    # A prefix names a job only when it names one.
    for job_hash in (first, second):
        await client.call(subjects.SVC_TRAINER_SUBMIT, JobSubmit(
            job_hash=job_hash, params={"max_steps": 1}, dataset_sha256=dataset, dataset_bytes=1, examples=1))
    assert (await client.get("abc2")).job_hash == second
    assert await refused(subjects.SVC_TRAINER_GET, {"job": "abc"}) == 422
    assert (await client.get("latest")).job_hash == second
    listed = JobList.model_validate(await client.call(subjects.SVC_TRAINER_LIST))
    assert [j.job_hash for j in listed.jobs] == [second, first]  # newest first


def code_tar(files: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return buffer.getvalue()


async def test_user_code_is_refused_unless_allowed_and_unsafe_archives_always(start_trainer, client,
                                                                               jobs_dir):
    good = code_tar({"ml/loopline_user/__init__.py": b"VALUE = 42\n"})
    proc = await start_trainer("local")
    with pytest.raises(ServiceError) as caught:
        await client.submit({"max_steps": 1}, code=good)
    assert caught.value.status == 403 and "user code" in caught.value.message
    assert [p.name for p in jobs_dir.iterdir() if not p.name.startswith(".")] == []
    processes.stop(proc)

    # job_user root: the stand-in is this environment's python, which may live where nobody cannot
    # enter (/root/.pyenv); tests/trainer/test_job_env.py runs user code as nobody.
    await start_trainer("local", allow_user_code="true", job_user="root")
    for bad in (code_tar({"ml/../../escaped.py": b"x"}), code_tar({"/tmp/absolute.py": b"x"}),
                code_tar({"ml/ok.py": b"x"}, links={"ml/out": "/etc"}),
                code_tar({"ml/ok.py": b"x"}, links={"ml/up": "../../.."}),
                code_tar({"not-ml/x.py": b"x"})):
        with pytest.raises(ServiceError) as caught:
            await client.submit({"max_steps": 1}, code=bad)
        assert caught.value.status == 422, caught.value.message
    assert [p.name for p in jobs_dir.iterdir() if not p.name.startswith(".")] == []
    assert not (jobs_dir.parent / "escaped.py").exists()

    info = await client.submit({"max_steps": 2}, code=good)
    assert info.code_origin == "shipped"
    job_dir = jobs_dir / info.job_hash
    assert (job_dir / "ml" / "loopline_user" / "__init__.py").read_bytes() == b"VALUE = 42\n"
    assert f"export PYTHONPATH={job_dir}/ml" in (control_dir(job_dir) / ENTRYPOINT_FILE).read_text()
    done = await client.wait_status(info.job_hash, "COMPLETED")
    assert done.code_sha256 == info.code_sha256


async def test_squeue_cluster_and_status(launcher_kind, start_trainer, client):
    await start_trainer(launcher_kind)
    info = await client.submit({"max_steps": 40, "standin_step_s": 0.1})
    await client.events(info.job_hash, until="started")
    squeue = SqueueReply.model_validate(await client.call(subjects.SVC_TRAINER_SQUEUE))
    assert squeue.error_message is None and info.slurm_job_id in squeue.squeue_output
    cluster = ClusterInfo.model_validate(await client.call(subjects.SVC_TRAINER_CLUSTER))
    assert (cluster.launcher, cluster.node_count, cluster.gpu_count) == (launcher_kind, 1, 0)
    status = await client.call(subjects.SVC_TRAINER_STATUS)
    assert status["service"] == "trainer" and status["detail"]["launcher"] == launcher_kind
    assert status["detail"]["jobs"] in ({"QUEUED": 1}, {"TRAINING": 1})


async def test_tensor_parallel_runs_one_task_per_rank_under_srun(slurm, start_trainer, client, jobs_dir):
    await start_trainer("slurm")
    info = await client.submit({"max_steps": 3, "tensor_parallel": 2})
    job_dir = jobs_dir / info.job_hash
    assert "exec srun --ntasks=2 --kill-on-bad-exit=1" in (control_dir(job_dir) / ENTRYPOINT_FILE).read_text()
    await client.wait_status(info.job_hash, "COMPLETED")
    runs = sorted((job_dir / "runs.txt").read_text().splitlines())
    assert runs == ["start 0 rank 0/2", "start 0 rank 1/2"]


async def test_a_run_submitted_just_before_a_crash_is_adopted_not_doubled(launcher_kind, start_trainer,
                                                                         client, jobs_dir, tmp_path):
    first = await start_trainer(launcher_kind)
    info = await client.submit({"max_steps": 60, "standin_step_s": 0.1})
    await client.events(info.job_hash, until="started")
    processes.kill(first)
    # As if the trainer had died after sbatch returned and before it recorded the run.
    with sqlite3.connect(tmp_path / "loopline.db") as db:
        db.execute("UPDATE jobs SET slurm_job_id = NULL, attempts = 0 WHERE job_hash = ?", (info.job_hash,))

    await start_trainer(launcher_kind)
    # Invariant: the restarted trainer has not adopted a run yet (polled: it says so only when asked).
    while (now := await client.get(info.job_hash)).slurm_job_id is None:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    assert now.slurm_job_id == info.slurm_job_id and now.status.value == "TRAINING"
    await asyncio.sleep(0.5)  # a few reconcile passes: still the one run
    assert (await client.get(info.job_hash)).slurm_job_id == info.slurm_job_id
    assert (jobs_dir / info.job_hash / "runs.txt").read_text().count("start") == 1
