"""API keys on a real gateway process: the openai client with the right key gets through, without
or with a wrong one it gets 401 in OpenAI's error shape, and the health probe stays open."""

from __future__ import annotations

import httpx
import openai
import pytest

from loopline.common.local import launcher
from support.gateway_process import start_gateway

KEYS = "key-one,key-two"


@pytest.fixture(scope="module")
def keyed_gateway(nats_proc, tmp_path_factory):
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("keyed"), LOOPLINE_API_KEYS=KEYS)
    yield gw
    launcher.stop(gw.proc)


def test_right_key_passes_the_gate(keyed_gateway):
    client = openai.OpenAI(base_url=f"{keyed_gateway.url}/v1", api_key="key-two", max_retries=0)
    # No inference replica runs here: past the gate, the model list is simply empty.
    assert client.models.list().data == []


@pytest.mark.parametrize("key", ["wrong", ""])
def test_wrong_or_missing_key_is_401(keyed_gateway, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(f"{keyed_gateway.url}/v1/completions", headers=headers,
                   json={"model": "m", "prompt": "x"})
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert "API key" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_gateway.url}/v1", api_key=key or "none",
                      max_retries=0).models.list()


def test_scalarlm_routes_are_gated_too_and_the_probe_is_open(keyed_gateway):
    assert httpx.get(f"{keyed_gateway.url}/v1/megatron/list_models").status_code == 401
    assert httpx.get(f"{keyed_gateway.url}/v1/health/keepalive").status_code == 200


def test_no_keys_configured_means_no_gate(gateway):
    assert httpx.get(f"{gateway.url}/v1/megatron/list_models").status_code == 200
