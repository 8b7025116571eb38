"""The chart never installs an open gateway: with no keys given it makes a Secret holding one random
key and gives it to the gateway; only ``gateway.apiKeys.allowOpenGateway: true`` (and no keys)
leaves the gateway without keys, and NOTES.txt says so. The rendered key is tried on a real gateway."""

from __future__ import annotations

import base64
import json
import re

import httpx
import pytest

from loopline.common.local import launcher
from support.deploy import CHECK_CHART, render_chart
from support.gateway_process import start_gateway

SECRET = "demo-loopline-api-keys"
OPEN = {"gateway": {"apiKeys": {"allowOpenGateway": True}}}


def _secrets(chart: dict) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in o["data"].items()}
            for o in chart["objects"] if o["kind"] == "Secret"}


def _gateway_env(chart: dict) -> dict[str, dict]:
    gateway = next(o for o in chart["objects"]
                   if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-loopline-gateway")
    return {e["name"]: e for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_defaults_make_a_random_key_in_a_secret_and_the_gateway_wants_it(charts, nats_url, tmp_path):
    chart = charts["chart-defaults"]
    key = _secrets(chart)[SECRET]["api-keys"]
    assert re.fullmatch(r"tml-[A-Za-z0-9]{44}", key), key  # the Tinker SDK's prefix, ~260 random bits
    ref = _gateway_env(chart)["LOOPLINE_API_KEYS"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": SECRET, "key": "api-keys"}
    assert f"get secret {SECRET}" in chart["notes"] and "WARNING" not in chart["notes"]
    # The rendered key, as the pod gets it, on a real gateway: it gets in, no key and others do not.
    gateway = start_gateway(nats_url, tmp_path, LOOPLINE_API_KEYS=key)
    try:
        assert httpx.get(f"{gateway.url}/v1/health", headers={"Authorization": f"Bearer {key}"},
                         timeout=10).status_code == 200
        for headers in ({}, {"Authorization": "Bearer tml-" + "x" * 44}):
            refused = httpx.get(f"{gateway.url}/v1/health", headers=headers, timeout=10)
            assert refused.status_code == 401, refused.text
    finally:
        launcher.stop(gateway.proc)


def test_each_install_gets_its_own_key(tools, charts):
    # Offline there is no Secret to look up, so each render is a first install.
    again = render_chart(tools)
    assert _secrets(again)[SECRET]["api-keys"] != _secrets(charts["chart-defaults"])[SECRET]["api-keys"]


def test_keys_given_are_the_secrets(tools):
    chart = render_chart(tools, set_json={"gateway": {"apiKeys": {"keys": ["tml-one", "tml-two"]}}})
    assert _secrets(chart)[SECRET]["api-keys"] == "tml-one,tml-two"


def test_existing_secret_is_used_and_none_is_made(tools):
    mine = {"existingSecret": "mine", "secretKey": "k"}
    chart = render_chart(tools, set_json={"gateway": {"apiKeys": mine}})
    assert SECRET not in _secrets(chart)
    ref = _gateway_env(chart)["LOOPLINE_API_KEYS"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "mine", "key": "k"}


def test_open_gateway_only_when_opted_out_by_name(tools):
    chart = render_chart(tools, set_json=OPEN)
    assert SECRET not in _secrets(chart)
    assert "LOOPLINE_API_KEYS" not in _gateway_env(chart)
    assert "WARNING: gateway.apiKeys.allowOpenGateway is true: the gateway has NO API keys" in chart["notes"]


@pytest.mark.parametrize(("values", "reason"), [
    ({"gateway": {"apiKeys": {"allowOpenGateway": True, "keys": ["k1"]}}}, "choose one"),
    ({"gateway": {"apiKeys": {"allowOpenGateway": True, "existingSecret": "mine"}}}, "choose one"),
    ({"gateway": {"apiKeys": {"allowOpenGateway": "yes"}}}, "allowOpenGateway"),
])
def test_an_opt_out_beside_keys_or_not_a_boolean_is_refused(tools, values, reason):
    out = tools.run(tools.python, str(CHECK_CHART), "render", "--set-json", json.dumps(values))
    assert out.returncode == 3 and reason in out.stderr, (out.returncode, out.stderr[-500:])
