#!/usr/bin/env bash
# Create .venv-skyrl: SkyRL 0.4.0's Tinker server (JAX backend, CPU), the peer that
# bench/peer_tinker.py compares Loopline's Tinker API with, plus the tinker==0.25.0 SDK the bench's
# client script runs on. Idempotent: a second run only reinstalls when this script changed.
#
# One venv serves both sides of the comparison: SkyRL pins tinker>=0.25,<0.26 itself, and 0.25.0 is
# the newest SDK both servers accept (SkyRL sends no sample_sequence_ids, which SDK >= 0.26 needs),
# so the client needs no venv of its own. Loopline's .venv (tinker 0.38) is not used by the client.
#
# SkyRL needs Python >= 3.12 (3.11: numpy 2.5 builds from source, jax >= 0.11.1 has no wheels);
# pyenv's 3.12.1 is used. torch is there only because peft imports it; the CPU wheel is pinned so
# the registry's CUDA build is not pulled. About 6 GB.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-/root/.pyenv/versions/3.12.1/bin/python}
VENV=${LOOPLINE_SKYRL_VENV:-.venv-skyrl}
stamp="$VENV/.loopline-skyrl-installed"
want=$(sha256sum scripts/install_skyrl.sh | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# The repository's .gitignore names only .venv/; this keeps the venv out of `git status` (and out of
# what the device tool copies) wherever it is put.
echo '*' > "$VENV/.gitignore"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip

pip install -q "skyrl[tinker,jax]==0.4.0" torch==2.13.0 uv psutil aiohttp tinker==0.25.0

# Both sides import: the server's module and the client SDK at the version the bench relies on.
"$VENV/bin/python" -c "import skyrl.tinker.api, tinker, jax; assert tinker.__version__ == '0.25.0', tinker.__version__"

echo "$want" > "$stamp"
echo "installed skyrl into $VENV"
