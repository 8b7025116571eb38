"""Render the Loopline chart offline and check the result; run by the deploy tools' Python.

    check_chart.py                      every case below, then `helm lint --strict` (deploy/check.sh)
    check_chart.py render [-f VALUES]... [--set-json JSON]
                                        one rendering as JSON: {"objects", "notes", "errors"}, where
                                        errors are the manifests the Kubernetes schema refuses
    check_chart.py validate             a JSON list of manifests on stdin -> JSON list of errors
    check_chart.py lint [-f VALUES]     helm lint --strict -> JSON list of errors

`render` exits 3 when the values are refused (schema or a template's `required`/`fail`), with the
reason on stderr. tests/deploy drives these commands from the project's pytest, which cannot import
the tools: they live in their own venv (deploy/install-tools.sh).

Needs helm-python-sdk (Helm's Go SDK as a library; no helm binary), kubernetes-validate and
PyYAML. Licence: CC0-1.0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CHART = Path(__file__).resolve().parent / "loopline"
# The API version manifests are validated against (strict: unknown fields are errors). Raise it
# with the oldest Kubernetes the chart supports.
KUBERNETES_VERSION = "1.30.0"
RELEASE = {"name": "demo", "namespace": "loopline"}
# API groups kubernetes-validate has no schema for (custom resources): their manifests are left to
# the tests that read them (tests/deploy/test_metrics.py checks what the PodMonitor selects).
CUSTOM_RESOURCE_GROUPS = ("monitoring.coreos.com/",)

# name -> values that must render to valid manifests (ci/gpu-values.yaml is rendered by the tests
# as a file, like a user would pass it)
GOOD: dict[str, dict] = {
    "defaults": {},
    "gpu inference, ingress, shared model cache": {
        "image": {"registry": "registry.example.com/ml", "tag": "1.2.3"},
        "otlpEndpoint": "http://otel-collector:4318",
        "gateway": {
            "replicas": 2,
            "env": {"LOOPLINE_RESPONSE_TIMEOUT_S": 30},
            "apiKeys": {"keys": ["key-one", "key-two"]},
            "ingress": {"enabled": True, "className": "nginx",
                        "tls": [{"secretName": "loopline-tls", "hosts": ["loopline.example.com"]}]},
        },
        "inference": {
            "gpus": 2, "replicas": 3, "maxModelLen": 2048,
            "deployments": [{"name": "", "servedModelName": "smol"}],
            "extraEnv": [{"name": "HF_TOKEN",
                          "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}],
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
        "modelCache": {"enabled": True, "accessMode": "ReadWriteMany"},
    },
    "external nats and postgres url, load balancer": {
        "nats": {"enabled": False, "externalUrl": "nats://nats.infra:4222"},
        "postgres": {"enabled": False, "externalUrl": "postgresql://loopline:pw@db.infra:5432/loopline"},
        "gateway": {"service": {"type": "LoadBalancer", "port": 80}},
    },
    "external nats and postgres from secrets, node port": {
        "nats": {"enabled": False, "externalUrlSecret": {"name": "loopline-nats-url", "key": "url"}},
        "postgres": {"enabled": False, "externalUrlSecret": {"name": "loopline-db", "key": "url"}},
        "gateway": {"service": {"type": "NodePort", "port": 8000}},
    },
    "existing secrets and claims": {
        "postgres": {"existingSecret": "loopline-pg"},
        "nats": {"auth": {"existingSecret": "loopline-nats"}},
        "slurm": {"munge": {"existingSecret": "loopline-munge"}},
        "modelCache": {"enabled": True, "existingClaim": "models"},
        "jobs": {"existingClaim": "loopline-jobs"},
    },
    "no nats auth, fixed passwords, fullnameOverride": {
        "nats": {"auth": {"enabled": False}},
        "postgres": {"password": "s3cret"},
        "fullnameOverride": "ll",
    },
    "training without slurm (local launcher)": {"slurm": {"enabled": False}, "trainer": {"gpus": 1}},
    "serving only": {"trainer": {"enabled": False}, "checkpointWatcher": {"enabled": False},
                     "slurm": {"enabled": False}},
    "several deployments, each its own settings": {
        "inference": {"vllmArgs": "--seed 1", "deployments": [
            {"name": "chat", "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "servedModelName": "smol",
             "gpus": 1, "vllmArgs": "--enable-auto-tool-choice --tool-call-parser hermes"},
            {"name": "", "model": "BAAI/bge-small-en-v1.5", "replicas": 2, "adapters": False,
             "env": {"LOOPLINE_MAX_DELIVER": 3}, "nodeSelector": {"pool": "cpu"}},
        ]},
    },
    "metrics off": {"metrics": {"enabled": False}},
    "open gateway, opted out by name": {"gateway": {"apiKeys": {"allowOpenGateway": True}}},
    "pod monitor, no scrape annotations, another port": {
        "metrics": {"port": 9090, "scrapeAnnotations": False,
                    "podMonitor": {"enabled": True, "interval": "30s",
                                   "labels": {"release": "kube-prometheus-stack"}}},
        "gateway": {"podAnnotations": {"example.com/team": "ml"}},
    },
}

# name -> values that must be refused (by the schema or by a template's `required`)
BAD: dict[str, dict] = {
    "unknown key": {"inference": {"gpu": 1}},
    "no deployment": {"inference": {"deployments": []}},
    "two deployments with one name": {"inference": {"deployments": [{"name": "a"}, {"name": "a"}]}},
    "two deployments without a name": {"inference": {"deployments": [{"model": "a"}, {"model": "b"}]}},
    "deployment name that is no DNS label": {"inference": {"deployments": [{"name": "Chat_1"}]}},
    "unknown key in a deployment": {"inference": {"deployments": [{"name": "", "image": {}}]}},
    "negative replicas": {"gateway": {"replicas": -1}},
    "external nats without url": {"nats": {"enabled": False}},
    "external postgres without url": {"postgres": {"enabled": False}},
    "password not url-safe": {"postgres": {"password": "p@ss/word"}},
    "nats password not url-safe": {"nats": {"auth": {"passwords": {"gateway": "abcdefghij:b@c"}}}},
    "nats password nats-server would read as a number": {
        "nats": {"auth": {"passwords": {"queue": "123456789012"}}}},
    "nats password for no role": {"nats": {"auth": {"passwords": {"admin": "abcdefghijkl"}}}},
    "api key with a comma": {"gateway": {"apiKeys": {"keys": ["a,b"]}}},
    "open gateway beside keys": {"gateway": {"apiKeys": {"allowOpenGateway": True, "keys": ["k1"]}}},
    "open gateway as a string": {"gateway": {"apiKeys": {"allowOpenGateway": "yes"}}},
    "zero compute cpus": {"slurm": {"compute": {"cpus": 0}}},
    "negative gpus": {"slurm": {"compute": {"gpus": -1}}},
    "bad jobs size": {"jobs": {"size": "lots"}},
    "model cache under inference (moved to the top level)": {"inference": {"modelCache": {"enabled": True}}},
    "ephemeral metrics port (nothing could scrape it)": {"metrics": {"port": 0}},
    "metrics port that is the gateway's port": {"metrics": {"port": 8000}},
    "unknown key in metrics": {"metrics": {"serviceMonitor": {"enabled": True}}},
    "pod monitor interval Prometheus cannot parse": {"metrics": {"podMonitor": {"interval": "30"}}},
}


class Refused(Exception):
    """The chart refused these values."""


def merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge(out[key], value) if both else value
    return out


def render(values: dict) -> dict[str, str]:
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        try:
            chart.validate_schema(values)
            return chart.render(values=values, is_install=True, **RELEASE)
        except helm.HelmError as exc:
            raise Refused(str(exc).strip()) from exc


def manifests(rendered: dict[str, str]) -> list[dict]:
    import yaml

    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def validate(docs: list[dict]) -> list[dict]:
    import kubernetes_validate

    errors = []
    for doc in docs:
        name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
        if str(doc.get("apiVersion", "")).startswith(CUSTOM_RESOURCE_GROUPS):
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except Exception as exc:  # noqa: BLE001 - every kind of refusal is reported
            errors.append({"object": name, "error": f"{type(exc).__name__}: {exc}"})
    return errors


def lint(values: dict | None = None) -> list[str]:
    import helm_python as helm

    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    return report["errors"] + [m["error"] for m in report["messages"] if m["severity"] >= 2]


def load_values(files: list[str], set_json: list[str]) -> dict:
    import yaml

    values: dict = {}
    for file in files:
        values = merge(values, yaml.safe_load(Path(file).read_text()) or {})
    for text in set_json:
        values = merge(values, json.loads(text))
    return values


def run_all() -> int:
    failures = []
    for name, values in GOOD.items():
        try:
            docs = manifests(render(values))
            errors = validate(docs)
        except Refused as exc:
            errors = [{"object": "values", "error": str(exc)}]
            docs = []
        if errors:
            failures.append(name)
            for error in errors:
                print(f"FAIL {name}: {error['object']}: {error['error']}")
        else:
            print(f"ok   {name}: {len(docs)} objects")
    for name, values in BAD.items():
        try:
            render(values)
        except Refused as exc:
            print(f"ok   refused {name}: {str(exc).splitlines()[-1]}")
        else:
            failures.append(name)
            print(f"FAIL {name}: accepted")
    errors = lint()
    for error in errors:
        print(f"FAIL lint: {error}")
    if errors:
        failures.append("lint")
    else:
        print("ok   helm lint --strict")
    print(f"{len(GOOD) + len(BAD) + 1 - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    for name in ("render", "lint"):
        cmd = sub.add_parser(name)
        cmd.add_argument("-f", "--values", action="append", default=[])
        cmd.add_argument("--set-json", action="append", default=[])
    sub.add_parser("validate")
    args = parser.parse_args(argv)
    if args.command is None:
        return run_all()
    if args.command == "validate":
        json.dump(validate(json.load(sys.stdin)), sys.stdout)
        return 0
    values = load_values(args.values, args.set_json)
    if args.command == "lint":
        json.dump(lint(values), sys.stdout)
        return 0
    try:
        rendered = render(values)
    except Refused as exc:
        print(exc, file=sys.stderr)
        return 3
    docs = manifests(rendered)
    json.dump({"objects": docs, "notes": rendered.get("loopline/templates/NOTES.txt", ""),
               "errors": validate(docs)}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
