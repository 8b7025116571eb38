"""Several deployments in the chart (``inference.deployments``): one inference Deployment per model,
each with its own replicas, settings and pod selector, the inference-level values shared unless an
entry replaces them, and the gateway's default model the first entry's."""

from __future__ import annotations

from support.deploy import render_chart


def _inference(chart: dict) -> dict[str, dict]:
    """Deployment name -> {"replicas", "env" (name -> value or None), "container", "pod", "selector"}."""
    out = {}
    for obj in chart["objects"]:
        if obj["kind"] == "Deployment" and obj["metadata"]["name"].startswith("demo-loopline-inference"):
            pod = obj["spec"]["template"]["spec"]
            container = pod["containers"][0]
            out[obj["metadata"]["name"]] = {
                "replicas": obj["spec"]["replicas"], "container": container, "pod": pod,
                "env": {e["name"]: e.get("value") for e in container["env"]},
                "selector": obj["spec"]["selector"]["matchLabels"],
                "labels": obj["spec"]["template"]["metadata"]["labels"]}
    return out


def _gateway_model(chart: dict) -> str:
    gateway = next(o for o in chart["objects"] if o["metadata"]["name"] == "demo-loopline-gateway"
                   and o["kind"] == "Deployment")
    env = gateway["spec"]["template"]["spec"]["containers"][0]["env"]
    return next(e["value"] for e in env if e["name"] == "LOOPLINE_MODEL")


def test_defaults_are_one_deployment_of_the_model(charts):
    chart = charts["chart-defaults"]
    [(name, only)] = _inference(chart).items()
    assert name == "demo-loopline-inference" and only["replicas"] == 1
    assert only["env"]["LOOPLINE_MODEL"] == _gateway_model(chart) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "LOOPLINE_VLLM_ARGS" not in only["env"] and only["env"]["LOOPLINE_ADAPTERS"] == "true"


def test_gpu_values_serve_a_generation_and_an_embedding_model(charts):
    chart = charts["chart-gpu"]
    deployments = _inference(chart)
    chat, embed = deployments["demo-loopline-inference"], deployments["demo-loopline-inference-embed"]
    assert (chat["replicas"], embed["replicas"]) == (4, 1)
    assert chat["env"]["LOOPLINE_MODEL"] == _gateway_model(chart) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert chat["env"]["LOOPLINE_VLLM_ARGS"] == "--enable-auto-tool-choice --tool-call-parser hermes"
    assert chat["env"]["LOOPLINE_ADAPTERS"] == "true"
    assert embed["env"]["LOOPLINE_MODEL"] == "BAAI/bge-small-en-v1.5"
    assert embed["env"]["LOOPLINE_VLLM_ARGS"] == "--max-model-len 512"
    assert embed["env"]["LOOPLINE_ADAPTERS"] == "false"
    # What the entry leaves out is the inference-level value: GPUs, the secret, the node pool.
    for deployment in (chat, embed):
        assert deployment["container"]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "HF_TOKEN" in deployment["env"]
        assert deployment["pod"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert embed["container"]["resources"]["limits"]["memory"] == "16Gi"  # its own
    assert chat["container"]["resources"]["limits"]["memory"] == "64Gi"
    # Each Deployment selects its own pods only: neither selector matches the other's pod labels.
    assert chat["selector"].items() <= chat["labels"].items()
    assert not chat["selector"].items() <= embed["labels"].items()
    assert not embed["selector"].items() <= chat["labels"].items()


def test_an_entry_replaces_a_value_and_merges_env(tools):
    chart = render_chart(tools, set_json={"inference": {
        "env": {"LOOPLINE_MAX_DELIVER": "3", "LOOPLINE_ACK_WAIT_S": "10"},
        "deployments": [
            {"name": "chat", "servedModelName": "smol", "maxInflight": 8},
            {"name": "", "model": "tiny-embed", "adapters": False, "env": {"LOOPLINE_ACK_WAIT_S": "20"}},
        ]}})
    deployments = _inference(chart)
    chat, embed = deployments["demo-loopline-inference-chat"], deployments["demo-loopline-inference"]
    assert _gateway_model(chart) == chat["env"]["LOOPLINE_SERVED_MODEL_NAME"] == "smol"
    assert chat["env"]["LOOPLINE_MAX_INFLIGHT"] == "8" and embed["env"]["LOOPLINE_MAX_INFLIGHT"] == "64"
    assert (chat["env"]["LOOPLINE_ACK_WAIT_S"], embed["env"]["LOOPLINE_ACK_WAIT_S"]) == ("10", "20")
    assert embed["env"]["LOOPLINE_MAX_DELIVER"] == "3"
    assert embed["env"]["LOOPLINE_MODEL"] == "tiny-embed" and "LOOPLINE_SERVED_MODEL_NAME" not in embed["env"]
    assert chart["errors"] == []
