"""A second deployment in compose (deploy/compose/docker-compose.embeddings.yml): an inference
service of its own that extends the root file's, with its own model and settings, each a variable
the inference service reads, while the gateway's default model stays the first deployment's."""

from __future__ import annotations

import os

from loopline.common.config.settings import InferenceSettings
from support.deploy import COMPOSE, ROOT, compose_config, settings_env_names

EMBEDDINGS = ROOT / "deploy" / "compose" / "docker-compose.embeddings.yml"


def test_embedding_deployment_beside_the_generation_model(tools, monkeypatch):
    services = compose_config(tools, [COMPOSE, EMBEDDINGS])["services"]
    first, second = services["inference"], services["inference-embed"]
    # The same image, build, model cache and shutdown grace as the first deployment's replicas.
    for key in ("image", "build", "volumes", "shm_size", "stop_grace_period", "depends_on"):
        assert second[key] == first[key], key
    env = second["environment"]
    assert env["LOOPLINE_MODEL"] == "BAAI/bge-small-en-v1.5" != first["environment"]["LOOPLINE_MODEL"]
    assert (env["LOOPLINE_ADAPTERS"], env["LOOPLINE_VLLM_ARGS"]) == ("false", "--max-model-len 512")
    assert env["LOOPLINE_NATS_URL"] == first["environment"]["LOOPLINE_NATS_URL"]
    assert services["gateway"]["environment"]["LOOPLINE_MODEL"] == first["environment"]["LOOPLINE_MODEL"]

    # Every LOOPLINE_* variable it sets is one the replica reads, with a value it accepts.
    loopline = {k: v for k, v in env.items() if k.startswith("LOOPLINE_")}
    assert set(loopline) <= set(settings_env_names(InferenceSettings))
    for key in [k for k in os.environ if k.upper().startswith("LOOPLINE_")]:
        monkeypatch.delenv(key)
    for key, value in loopline.items():
        monkeypatch.setenv(key, value)
    settings = InferenceSettings()
    assert settings.name == "BAAI/bge-small-en-v1.5" and settings.adapters is False
