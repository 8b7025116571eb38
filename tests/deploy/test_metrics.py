"""Prometheus metrics in the deployments. Every Loopline service's container, in the chart and in the
compose stacks, serves ``/metrics`` on one fixed port (LOOPLINE_METRICS_PORT: the runtime's default,
0, picks a port no scraper could know); in the chart its pod also says so to Prometheus (a container
port named ``metrics``, the prometheus.io/* annotations, optionally a PodMonitor), and a real runtime
process given the chart's environment answers where the annotations point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from loopline.common.config.settings import CommonSettings
from loopline.common.local import launcher
from loopline.common.runtime import metrics
from support.deploy import (
    CHART_VALUES,
    COMPOSE,
    COMPOSE_STACKS,
    ROOT,
    compose_config,
    load_check_chart,
    render_chart,
)
from support.scrape import scrape, value

# The port docs/deployment.md promises: values.yaml metrics.port, and every service in compose.
PORT = 9400
# The containers that run a Loopline service (on the shared runtime); in compose each further
# inference deployment is a service named inference-<name>.
LOOPLINE = {"gateway", "queue", "inference", "trainer", "checkpoint-watcher"}
SCRAPE = ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path")
EMBEDDINGS = ROOT / "deploy" / "compose" / "docker-compose.embeddings.yml"
CASES = load_check_chart()


def _is_loopline(name: str) -> bool:
    return name in LOOPLINE or name.startswith("inference-")


def _pods(chart: dict) -> list[tuple[str, dict, dict]]:
    """(workload name, pod template, its one container) for every Deployment and StatefulSet."""
    return [(o["metadata"]["name"], o["spec"]["template"], o["spec"]["template"]["spec"]["containers"][0])
            for o in chart["objects"] if o["kind"] in ("Deployment", "StatefulSet")]


def _env(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _metrics_port(container: dict) -> int | None:
    return next((p["containerPort"] for p in container.get("ports", []) if p["name"] == "metrics"), None)


def _settings_port(monkeypatch, value: str) -> int:
    """What the runtime of a process with LOOPLINE_METRICS_PORT=value binds (its settings' field)."""
    monkeypatch.setenv("LOOPLINE_METRICS_PORT", value)
    return CommonSettings().metrics_port


@pytest.mark.parametrize("name", sorted(CHART_VALUES))
def test_every_loopline_pod_serves_metrics_where_its_annotations_say(charts, monkeypatch, name):
    served = set()
    for workload, pod, container in _pods(charts[name]):
        annotations = pod["metadata"].get("annotations", {})
        if not _is_loopline(container["name"]):
            # NATS, PostgreSQL, Slurm: nothing there speaks Prometheus; a scrape would only fail.
            assert not set(SCRAPE) & set(annotations), workload
            assert "LOOPLINE_METRICS_PORT" not in _env(container), workload
            continue
        served.add(workload)
        port = _settings_port(monkeypatch, _env(container)["LOOPLINE_METRICS_PORT"])
        assert port == PORT == _metrics_port(container), workload
        assert annotations["prometheus.io/scrape"] == "true", workload
        assert annotations["prometheus.io/port"] == str(port), workload
        assert annotations["prometheus.io/path"] == metrics.PATH, workload
    expected = {f"demo-loopline-{c}" for c in LOOPLINE}
    if name != "chart-defaults":
        expected.add("demo-loopline-inference-embed")  # every deployment of inference.deployments
    assert served == expected


def test_gateway_serves_metrics_beside_its_http_port(charts):
    gateway = next(c for _, _, c in _pods(charts["chart-defaults"]) if c["name"] == "gateway")
    assert {p["name"]: p["containerPort"] for p in gateway["ports"]} == {"http": 8000, "metrics": PORT}


def test_metrics_off_turns_the_servers_off_and_keeps_pod_annotations(tools, monkeypatch):
    chart = render_chart(tools, set_json={"metrics": {"enabled": False},
                                          "queue": {"podAnnotations": {"example.com/team": "ml"}}})
    assert chart["errors"] == []
    loopline = [(w, p, c) for w, p, c in _pods(chart) if _is_loopline(c["name"])]
    assert len(loopline) == len(LOOPLINE)
    for workload, pod, container in loopline:
        port = _settings_port(monkeypatch, _env(container)["LOOPLINE_METRICS_PORT"])
        assert metrics.serve_metrics(port) is None, f"{workload} would still open a metrics port"
        assert _metrics_port(container) is None, workload
        assert not set(SCRAPE) & set(pod["metadata"].get("annotations", {})), workload
    queue = next(p for w, p, _ in loopline if w == "demo-loopline-queue")
    assert queue["metadata"]["annotations"] == {"example.com/team": "ml"}
    assert "metrics" not in chart["notes"].lower()


def test_a_pods_own_annotations_win_over_the_scrape_annotations(tools):
    chart = render_chart(tools, set_json={"queue": {"podAnnotations": {"prometheus.io/scrape": "false"}}})
    scrape_of = {w: p["metadata"]["annotations"]["prometheus.io/scrape"]
                 for w, p, c in _pods(chart) if _is_loopline(c["name"])}
    assert scrape_of.pop("demo-loopline-queue") == "false"
    assert set(scrape_of.values()) == {"true"}
    # The trainer's own annotation (its slurm.conf checksum) is kept beside them.
    trainer = next(p for w, p, _ in _pods(chart) if w == "demo-loopline-trainer")
    assert "checksum/config" in trainer["metadata"]["annotations"]


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, and matchExpressions with In) applied to labels."""
    if not selector["matchLabels"].items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression  # the only one the chart writes
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def test_pod_monitor_selects_every_loopline_pod_and_nothing_else(tools):
    values = dict(CASES.GOOD["pod monitor, no scrape annotations, another port"])
    values["inference"] = {"deployments": [{"name": ""}, {"name": "embed", "model": "tiny-embed"}]}
    chart = render_chart(tools, set_json=values)
    assert chart["errors"] == []
    [monitor] = [o for o in chart["objects"] if o["kind"] == "PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "metrics", "path": metrics.PATH, "interval": "30s"}
    selected = set()
    for workload, pod, container in _pods(chart):
        if _selects(monitor["spec"]["selector"], pod["metadata"]["labels"]):
            selected.add(workload)
            assert _metrics_port(container) == 9090, workload
        # With the annotations off, only the PodMonitor tells Prometheus (no pod is scraped twice).
        assert not set(SCRAPE) & set(pod["metadata"].get("annotations", {})), workload
    assert selected == {f"demo-loopline-{c}" for c in LOOPLINE} | {"demo-loopline-inference-embed"}


def test_no_pod_monitor_unless_asked(charts):
    for chart in charts.values():
        assert not [o for o in chart["objects"] if o["kind"] == "PodMonitor"]


def test_the_runtime_given_the_charts_environment_answers_where_the_annotations_point(
        tools, nats_url, tmp_path):
    """A real process on the shared runtime (tests/support/runtime_probe.py), with the
    LOOPLINE_METRICS_PORT the chart gives the queue's container, scraped as Prometheus would from
    the pod's annotations."""
    chart = render_chart(tools, set_json={"metrics": {"port": launcher.free_port()}})
    [(pod, container)] = [(p, c) for _, p, c in _pods(chart) if c["name"] == "queue"]
    annotations = pod["metadata"]["annotations"]
    url = f"http://127.0.0.1:{annotations['prometheus.io/port']}{annotations['prometheus.io/path']}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "tests"), env.get("PYTHONPATH")) if p),
               LOOPLINE_NATS_URL=nats_url, LOOPLINE_REPLICA_ID="queue-0",
               LOOPLINE_METRICS_PORT=_env(container)["LOOPLINE_METRICS_PORT"])
    log = tmp_path / "probe.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "support.runtime_probe", "stop"],
                                   env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        # Invariant: the process is alive and has not answered a scrape yet.
        while True:
            assert process.poll() is None, log.read_text()
            try:
                samples = scrape(url)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, f"nothing answered at {url}:\n{log.read_text()}"
                time.sleep(0.1)
        assert value(samples, "loopline_service_info", role="probe", replica="queue-0") == 1
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log.read_text()


@pytest.mark.parametrize("stack", [*sorted(COMPOSE_STACKS), "compose+embeddings"])
def test_compose_gives_every_service_a_fixed_metrics_port(tools, compose_stacks, monkeypatch, stack):
    config = compose_stacks.get(stack) or compose_config(tools, [COMPOSE, EMBEDDINGS])
    loopline = set()
    for name, service in config["services"].items():
        env = service.get("environment") or {}
        if not _is_loopline(name):
            assert "LOOPLINE_METRICS_PORT" not in env, name
            continue
        loopline.add(name)
        # Scraped at <service>:9400 on the project's network: each container has its own, so
        # every service (and every replica of a scaled one) uses the same port.
        assert _settings_port(monkeypatch, env["LOOPLINE_METRICS_PORT"]) == PORT, name
        published = {str(p.get("target")) for p in service.get("ports", [])}
        assert str(PORT) not in published, f"{name} publishes its metrics port on the host"
    assert loopline >= LOOPLINE
    if stack == "compose+embeddings":
        assert "inference-embed" in loopline
