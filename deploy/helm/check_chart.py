"""Render the Loopline chart offline for a set of value combinations and check the result.

For each case: the values pass values.schema.json, every template renders, every manifest parses
as YAML and validates against the Kubernetes API schema (strict: unknown fields are errors).
Values that must be refused (typos, bad enums, missing external URLs) are checked to be refused.
Then `helm lint --strict`.

Needs helm-python-sdk (Helm's Go SDK as a library; no helm binary), kubernetes-validate and
PyYAML: deploy/check.sh installs them into a side venv and runs this.
"""

from __future__ import annotations

import sys
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml

CHART = Path(__file__).resolve().parent / "loopline"
KUBERNETES_VERSION = "1.30.0"

# name -> values that must render to valid manifests
GOOD: dict[str, dict] = {
    "defaults": {},
    "gpu, ingress, shared model cache": {
        "image": {"registry": "registry.example.com/ml", "tag": "1.2.3"},
        "otlpEndpoint": "http://otel-collector:4317",
        "gateway": {
            "replicas": 2,
            "env": {"LOOPLINE_RESPONSE_TIMEOUT_S": 30},
            "ingress": {"enabled": True, "className": "nginx",
                        "tls": [{"secretName": "loopline-tls", "hosts": ["loopline.example.com"]}]},
        },
        "inference": {
            "gpus": 2, "replicas": 3, "maxModelLen": 2048, "servedModelName": "smol",
            "modelCache": {"enabled": True, "accessMode": "ReadWriteMany"},
            "extraEnv": [{"name": "HF_TOKEN",
                          "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}],
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
    },
    "external nats and postgres url, load balancer": {
        "nats": {"enabled": False, "externalUrl": "nats://nats.infra:4222"},
        "postgres": {"enabled": False, "externalUrl": "postgresql://loopline:pw@db.infra:5432/loopline"},
        "gateway": {"service": {"type": "LoadBalancer", "port": 80}},
    },
    "external postgres url from a secret, node port": {
        "postgres": {"enabled": False, "externalUrlSecret": {"name": "loopline-db", "key": "url"}},
        "gateway": {"service": {"type": "NodePort", "port": 8000}},
    },
    "existing secrets and claim": {
        "postgres": {"existingSecret": "loopline-pg"},
        "inference": {"modelCache": {"enabled": True, "existingClaim": "models"}},
    },
    "fixed password, fullnameOverride": {"postgres": {"password": "s3cret"}, "fullnameOverride": "ll"},
}

# name -> values that must be refused (by the schema or by a template's `required`)
BAD: dict[str, dict] = {
    "unknown key": {"inference": {"gpu": 1}},
    "unknown engine": {"inference": {"engine": "tgi"}},
    "negative replicas": {"gateway": {"replicas": -1}},
    "external nats without url": {"nats": {"enabled": False}},
    "external postgres without url": {"postgres": {"enabled": False}},
    "password not url-safe": {"postgres": {"password": "p@ss/word"}},
}


def render(chart: helm.Chart, values: dict) -> dict[str, str]:
    chart.validate_schema(values)
    return chart.render(values=values, name="demo", namespace="loopline", is_install=True)


def main() -> int:
    failures = []
    with helm.Chart.load(str(CHART)) as chart:
        for name, values in GOOD.items():
            try:
                manifests = render(chart, values)
                objects = []
                for path, text in sorted(manifests.items()):
                    if not path.endswith(".yaml"):
                        continue
                    for doc in yaml.safe_load_all(text):
                        if doc:
                            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
                            objects.append(f"{doc['kind']}/{doc['metadata']['name']}")
                print(f"ok   {name}: {len(objects)} objects ({', '.join(sorted(objects))})")
            except Exception as exc:  # noqa: BLE001 - report every case, then fail
                failures.append(name)
                print(f"FAIL {name}: {type(exc).__name__}: {exc}")
        for name, values in BAD.items():
            try:
                render(chart, values)
            except helm.HelmError as exc:
                print(f"ok   refused {name}: {str(exc).strip().splitlines()[-1]}")
            else:
                failures.append(name)
                print(f"FAIL {name}: accepted")
    report = helm.lint(str(CHART), strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    errors = report["errors"] + [m["error"] for m in report["messages"] if m["severity"] >= 2]
    for error in errors:
        print(f"FAIL lint: {error}")
    if errors:
        failures.append("lint")
    else:
        print("ok   helm lint --strict")
    print(f"{len(GOOD) + len(BAD) + 1 - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
