"""The trainer's part of the Tinker API that needs no model: checkpoints saved with a TTL are
forgotten and their files removed once it runs out (the session worker tests, which need one, are
tests/e2e/test_tinker_*.py)."""

from __future__ import annotations

import time

from loopline.common.config.settings import TrainerSettings
from loopline.common.contracts import tinker_names
from loopline.common.contracts.adapter_format import WEIGHTS_FILE
from loopline.common.contracts.job_layout import CHECKPOINTS_DIR
from loopline.common.contracts.tinker_schemas import TinkerCheckpoint
from loopline.trainer.launchers import make_launchers
from loopline.trainer.tinker_workers import SessionWorkers


async def test_expired_checkpoints_are_forgotten_and_their_files_removed(nc, tmp_path):
    settings = TrainerSettings(state_dir=tmp_path, launcher="local")
    launcher, launchers = make_launchers("local", settings.jobs_dir)
    workers = SessionWorkers(settings, launcher, launchers, nc, nc.jetstream())
    await workers.start()
    model_id = tinker_names.model_id(tinker_names.new_id(), 0)
    kept, gone = "kept", "gone"
    for name, expires_at in ((kept, time.time() + 3600), (gone, time.time() - 1)):
        folder = tinker_names.state_dir(workers.jobs_dir, model_id, name)
        folder.mkdir(parents=True)
        (folder / WEIGHTS_FILE).write_bytes(b"x")
        await workers.store.put_checkpoint(TinkerCheckpoint(
            model_id=model_id, checkpoint_type="training", name=name, expires_at=expires_at,
            tinker_path=str(tinker_names.TinkerPath(model_id, "weights", name))), "weights")
    sampler = tinker_names.sampler_hash(model_id, "old-sampler")
    (workers.jobs_dir / sampler / CHECKPOINTS_DIR).mkdir(parents=True)
    await workers.store.put_checkpoint(TinkerCheckpoint(
        model_id=model_id, checkpoint_type="sampler", name="old-sampler", adapter=sampler,
        tinker_path=str(tinker_names.TinkerPath(model_id, "sampler_weights", "old-sampler")),
        expires_at=time.time() - 1), "sampler_weights")

    assert await workers.expire_checkpoints() == 2
    assert [c.name for c in await workers.store.checkpoints(model_id)] == [kept]
    assert tinker_names.state_dir(workers.jobs_dir, model_id, kept).is_dir()
    assert not tinker_names.state_dir(workers.jobs_dir, model_id, gone).exists()
    assert not (workers.jobs_dir / sampler).exists()
    assert await workers.expire_checkpoints() == 0
