"""push_to_hub and API keys, on a real gateway process with a keys file and the real trainer holding
a Hub token: a training key without ``admin`` pushes only to a namespace the operator listed
(LOOPLINE_HUB_ALLOWED_NAMESPACES), an admin key anywhere; a public repo needs
LOOPLINE_HUB_ALLOW_PUBLIC whoever asks. Each refusal is a 422 at submission naming the setting."""

from __future__ import annotations

import json

import httpx
import pytest

from loopline.common.contracts.job_layout import DATASET_FILE
from loopline.common.local import launcher
from loopline.gateway.auth.key_store import KeyEntry, KeyFile, key_hash, new_key, write_key_file
from support.gateway_process import BASE_MODEL, start_gateway
from support.trainer_process import TrainerProcess
from support.training_data import EXAMPLES, archive, jsonlines

KEYS = {name: new_key() for name in ("tenant", "boss")}
SCOPES = {"tenant": ["training"], "boss": ["admin"]}
# Queued, never trained (the stand-in "loads its model" first): what is tested is the submission,
# so the trainer's token never has to reach a Hub.
LOADING = {"max_steps": 1, "standin_start_s": 120}


@pytest.fixture(scope="module")
def trainer(nats_proc, tmp_path_factory):
    state = tmp_path_factory.mktemp("trainer")
    (state / "hf-token").write_text("hf_operator_token")
    proc = TrainerProcess(nats_proc.info["url"], state, model=BASE_MODEL, hub_token_file=state / "hf-token",
                          hub_endpoint="http://127.0.0.1:9", hub_allowed_namespaces="tenants").start()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def keyed(nats_proc, trainer, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api_keys.json"
    write_key_file(path, KeyFile(keys=[KeyEntry(name=name, sha256=key_hash(key), scopes=SCOPES[name])
                                       for name, key in KEYS.items()]))
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("gateway"),
                       LOOPLINE_API_KEYS_FILE=str(path))
    yield gw
    launcher.stop(gw.proc)


def train(gw, key: str, push: dict) -> httpx.Response:
    data = archive({DATASET_FILE: jsonlines(EXAMPLES)})
    with httpx.Client(base_url=gw.url, timeout=30, headers={"Authorization": f"Bearer {KEYS[key]}"}) as http:
        return http.post("/v1/megatron/train", files={"file": ("dataset", data, "application/octet-stream")},
                         data={"params": json.dumps({**LOADING, "push_to_hub": push})})


def test_a_training_key_pushes_only_where_the_operator_allows(keyed):
    refused = train(keyed, "tenant", {"repo_id": "operator-org/production"})
    assert refused.status_code == 422, refused.text
    assert "LOOPLINE_HUB_ALLOWED_NAMESPACES" in refused.text and "admin key" in refused.text

    assert train(keyed, "tenant", {"repo_id": "tenants/mine"}).status_code == 200
    assert train(keyed, "boss", {"repo_id": "operator-org/production"}).status_code == 200


def test_a_public_repo_needs_the_operators_allowance_for_an_admin_too(keyed):
    for key in ("tenant", "boss"):
        refused = train(keyed, key, {"repo_id": "tenants/public", "private": False})
        assert refused.status_code == 422 and "LOOPLINE_HUB_ALLOW_PUBLIC" in refused.text, refused.text
