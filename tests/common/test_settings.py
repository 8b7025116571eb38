from pathlib import Path

import pytest

from loopline.common.config.settings import GatewaySettings, InferenceSettings, QueueSettings


def test_settings_read_loopline_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("LOOPLINE_PORT", "9123")
    monkeypatch.setenv("LOOPLINE_MAX_QUEUE_DEPTH", "7")
    monkeypatch.setenv("LOOPLINE_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("LOOPLINE_VLLM_ARGS", "--tool-call-parser hermes --enable-auto-tool-choice")
    assert GatewaySettings().port == 9123
    queue = QueueSettings()
    assert queue.max_queue_depth == 7
    assert queue.resolved_database_url() == f"sqlite:///{(tmp_path / 'loopline.db').resolve()}"
    inference = InferenceSettings()
    assert inference.vllm_args == "--tool-call-parser hermes --enable-auto-tool-choice"
    assert inference.models_dir == Path(tmp_path) / "models"
    monkeypatch.setenv("LOOPLINE_MODELS_DIR", "/shared/models")
    assert InferenceSettings().models_dir == Path("/shared/models")


def test_a_replica_refuses_several_models(monkeypatch):
    monkeypatch.setenv("LOOPLINE_MODEL", "tiny,tiny-embed")
    with pytest.raises(ValueError, match="a replica serves one model"):
        InferenceSettings()
