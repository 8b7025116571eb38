#!/usr/bin/env bash
# Create a venv of its own for tinker-cookbook 0.6.1, the client the Tinker API is tested against
# (its recipes run unmodified, offline, against a Loopline gateway). Kept apart from .venv so the
# platform's packages never satisfy, or hide, what the cookbook needs. Idempotent: a second run only
# reinstalls when this script changed.
#
# `pip install tinker-cookbook` fails here: it wants tml-renderers>=0.4.1 (used only by a few model
# families) and the registry has <= 0.2.1. So its dependencies are installed by name and the
# cookbook itself with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${LOOPLINE_COOKBOOK_VENV:-.venv-cookbook}
stamp="$VENV/.loopline-cookbook-installed"
want=$(sha256sum scripts/install_cookbook.sh | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# The repository's .gitignore names only .venv/; this keeps the venv out of `git status` (and out of
# what the device tool copies) wherever it is put.
echo '*' > "$VENV/.gitignore"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip

# The CPU torch first: pip takes it from the wheel on disk; the registry's newer torch pulls CUDA.
pip install -q torch==2.13.0
# Named again below so the resolver keeps it. transformers 5.3.0, 5.4.*, 5.5.0-5.5.3 and 5.6.* break
# the cookbook; 5.19.0 is the version .venv has, so both venvs tokenize alike.
pip install -q torch==2.13.0 tinker==0.38.0 transformers==5.19.0 aiohttp anyio blobfile chz \
  cloudpickle datasets huggingface-hub numpy pillow pydantic pyrage rich safetensors termcolor \
  tiktoken tqdm pylatexenc math-verify sympy matplotlib textarena
pip install -q --no-deps tinker-cookbook==0.6.1

# textarena: the cookbook's multiplayer-rl extra, which multiplayer_rl.text_arena imports.
# Importing the recipes proves the set is complete (the recipe matrix runs them all).
"$VENV/bin/python" -c "import tinker_cookbook.recipes.math_rl.train, tinker_cookbook.recipes.chat_sl.train, \
tinker_cookbook.recipes.multiplayer_rl.text_arena.train, textarena"

echo "$want" > "$stamp"
echo "installed tinker-cookbook into $VENV"
