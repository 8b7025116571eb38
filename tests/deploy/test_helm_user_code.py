"""The Helm chart keeps a job's own ml/ code off: its trainer runs as uid 10001 and could not run
that code as another uid (docs/security.md, "User code, per deployment mode")."""

from __future__ import annotations

import json

from support.deploy import CHECK_CHART, render_chart


def _trainer_env(chart: dict) -> dict[str, str]:
    (trainer,) = [o for o in chart["objects"]
                  if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("trainer")]
    return {e["name"]: e.get("value") for e in trainer["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_user_code_is_off_by_default(tools):
    assert _trainer_env(render_chart(tools))["LOOPLINE_ALLOW_USER_CODE"] == "false"


def test_turning_user_code_on_is_refused_saying_why(tools):
    values = {"trainer": {"allowUserCode": True}}
    out = tools.run(tools.python, str(CHECK_CHART), "render", "--set-json", json.dumps(values))
    assert out.returncode == 3, (out.returncode, out.stderr[-500:])
    assert "trainer.allowUserCode: this chart's trainer runs as uid 10001" in out.stderr
