"""Several deployments in one local stack: how ``LOOPLINE_MODEL`` and the per-deployment variables
(``LOOPLINE_<SETTING>__<MODEL KEY>``) turn into replicas, each with one model and its own settings.
The stacks themselves run in tests/e2e/test_deployments.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loopline.common.local.stack import Deployment, LocalStack, model_key, plan_deployments


def test_model_keys():
    assert model_key("tiny-embed") == "TINY_EMBED"
    assert model_key("HuggingFaceTB/SmolLM2-135M-Instruct") == "HUGGINGFACETB_SMOLLM2_135M_INSTRUCT"
    assert model_key("/data/models/e5.v2/") == "DATA_MODELS_E5_V2"
    assert "__" not in model_key("a--b__c//d")  # where a variable's key starts stays unambiguous


def test_one_model_is_one_deployment_as_before():
    [only] = plan_deployments("tiny", 2, {"LOOPLINE_VLLM_ARGS": "--seed 1"})
    assert only == Deployment("tiny", "TINY", "tiny", 2, {})


def test_each_model_gets_its_own_settings_and_replicas():
    environ = {
        "LOOPLINE_VLLM_ARGS__TINY_EMBED": "--no-enable-prefix-caching",
        "LOOPLINE_ADAPTERS__TINY_EMBED": "false",
        "LOOPLINE_INFERENCE_REPLICAS__TINY": "3",
        "LOOPLINE_SERVED_MODEL_NAME__TINY": "chat",
        "PATH__TINY": "not ours",  # not a Loopline variable: left alone
    }
    chat, embed = plan_deployments(" tiny , tiny-embed ,", 1, environ)
    assert chat == Deployment("tiny", "TINY", "chat", 3, {"LOOPLINE_SERVED_MODEL_NAME": "chat"})
    assert embed == Deployment("tiny-embed", "TINY_EMBED", "tiny-embed", 1, {
        "LOOPLINE_VLLM_ARGS": "--no-enable-prefix-caching", "LOOPLINE_ADAPTERS": "false"})


@pytest.mark.parametrize(("models", "environ", "message"), [
    ("", {}, "names no model"),
    (" , ", {}, "names no model"),
    ("tiny,tiny", {}, "share the key"),
    ("tiny-embed,tiny_embed", {}, "share the key 'TINY_EMBED'"),
    ("tiny,tiny-embed", {"LOOPLINE_VLLM_ARGS__TINY_EMBD": "x"}, "model key 'TINY_EMBD'"),
    ("tiny", {"LOOPLINE_MODEL__TINY": "other"}, "its entry in LOOPLINE_MODEL"),
    ("tiny,tiny-embed", {"LOOPLINE_SERVED_MODEL_NAME": "x"}, "one name"),
    ("tiny,tiny-embed", {"LOOPLINE_SERVED_MODEL_NAME__TINY": "tiny-embed"}, "under one name"),
    ("tiny", {"LOOPLINE_INFERENCE_REPLICAS__TINY": "two"}, "not a number of replicas"),
])
def test_stacks_that_cannot_be_what_was_asked_are_refused(models, environ, message):
    with pytest.raises(ValueError, match=message):
        plan_deployments(models, 1, environ)


def test_each_replica_gets_one_model_the_gateway_the_first(tmp_path):
    stack = LocalStack(tmp_path, "tiny,tiny-embed", replicas=2, env={
        "LOOPLINE_VLLM_ARGS": "--seed 7", "LOOPLINE_VLLM_ARGS__TINY_EMBED": "--no-enable-prefix-caching",
        "LOOPLINE_INFERENCE_REPLICAS__TINY_EMBED": "1"})
    chat, embed = stack.deployments
    assert stack.replica_names(chat) == ["tiny-r0", "tiny-r1"]
    assert stack.replica_names(embed) == ["tiny-embed-r0"]
    assert stack.replica_env(chat)["LOOPLINE_MODEL"] == "tiny"
    assert stack.replica_env(chat)["LOOPLINE_VLLM_ARGS"] == "--seed 7"  # unsuffixed: every deployment
    assert stack.replica_env(embed)["LOOPLINE_MODEL"] == "tiny-embed"
    assert stack.replica_env(embed)["LOOPLINE_VLLM_ARGS"] == "--no-enable-prefix-caching"
    assert stack.gateway_env()["LOOPLINE_MODEL"] == stack.default_model == "tiny"
    assert stack.env()["LOOPLINE_MODEL"] == "tiny"  # the trainer adapts the first model
    # One model: replica names and environment as they always were.
    single = LocalStack(tmp_path, "tiny", replicas=2)
    assert single.replica_names(single.deployments[0]) == ["r0", "r1"]
    assert single.replica_env(single.deployments[0]) == single.env()


def test_up_refuses_a_bad_deployment_plan_before_starting_anything(tmp_path):
    env = {**os.environ, "LOOPLINE_MODEL": "tiny,tiny-embed", "LOOPLINE_STATE_DIR": str(tmp_path),
           "LOOPLINE_ADAPTERS__TINY_EMBD": "false"}
    out = subprocess.run([sys.executable, "-m", "loopline.common.local.up"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "LOOPLINE_ADAPTERS__TINY_EMBD is for the model key 'TINY_EMBD'" in out.stderr
    assert not (tmp_path / "logs").exists()
