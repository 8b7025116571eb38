#!/usr/bin/env bash
# The cookbook proof of docs/tinker/README.md: tinker-cookbook 0.6.1's RL recipe (math_rl, the
# arithmetic task it generates itself) and its supervised recipe (chat_sl, on the conversations file
# it ships) run unmodified and offline against a Loopline stack on SmolLM2-135M-Instruct, on CPU.
# Writes the metrics and the curves beside this script. Takes ~40 min on 2 quiet cores.
#
#   docs/tinker/run_cookbook.sh            # both recipes
#   RECIPES=math_rl docs/tinker/run_cookbook.sh
#   RECIPES="math_rl_default.seed0 math_rl_default.seed1" docs/tinker/run_cookbook.sh  # default loss
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
out=$repo/docs/tinker
work=${WORK:-$(mktemp -d /tmp/loopline-cookbook.XXXXXX)}
recipes=${RECIPES:-math_rl chat_sl}
mkdir -p "$work"
echo "work dir: $work"

# 1. The cookbook's own venv (scripts/install_cookbook.sh says why it is apart from .venv).
bash scripts/install_cookbook.sh

# 2. The model as a local folder: the cookbook loads its tokenizer from model_name, and the gateway
# knows the base model by the same name. No ':' in it (the SDK splits tinker paths on it).
model=$(realpath "$(.venv/bin/python -m loopline.ml.models HuggingFaceTB/SmolLM2-135M-Instruct \
                     --models-dir .loopline/models | tail -1)")

# 3. A Loopline stack on free ports, session workers under the local launcher (no Slurm here).
# LOOPLINE_MAX_ADAPTER_RANK=32, the recipes' rank: vLLM pads every adapter to this rank, and on CPU
# its LoRA kernels gather each token's padded matrices, so sampling time grows with it (at 64, the
# default, one iteration's 32 samples took 80 s, 57 s of it prefilling 1,084 prompt tokens).
free_port() { .venv/bin/python -c 'from loopline.common.local.launcher import free_port; print(free_port())'; }
port=$(free_port)
url=http://127.0.0.1:$port
LOOPLINE_STATE_DIR=$work/state LOOPLINE_MODEL=$model LOOPLINE_LAUNCHER=local LOOPLINE_MAX_ADAPTER_RANK=32 \
  LOOPLINE_PORT=$port LOOPLINE_NATS_PORT=$(free_port) LOOPLINE_NATS_MONITOR_PORT=$(free_port) \
  .venv/bin/loopline up >"$work/up.log" 2>&1 &
up=$!
trap 'kill -TERM $up 2>/dev/null; wait $up || true' EXIT
trap 'exit 130' INT TERM
# Invariant: `loopline up` is alive and has not yet said the stack serves.
until grep -qs "Loopline is up" "$work/up.log"; do
  kill -0 $up 2>/dev/null || { cat "$work/up.log"; exit 1; }
  sleep 2
done
echo "stack up at $url (logs: $work/state/logs)"

# 4. The recipes, unmodified, offline. renderer_name: the cookbook's table knows Hub names only;
# loss_fn: these curves were made with importance_sampling (the RL CLI's default is stable_reinforce).
cookbook() {
  (cd "$work" && env HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TINKER_TELEMETRY=0 \
     TINKER_API_KEY=tml-loopline "$repo/.venv-cookbook/bin/python" -m "$@")
}
for recipe in $recipes; do
  started=$(date +%s)
  case $recipe in
    math_rl)
      # Measured in-process on SmolLM2: 3e-4 with rank 32 learns in 24 iterations; 1e-3 collapses,
      # max_tokens=8 is too short to finish an answer. 40 iterations: one 24-iteration run
      # here ended where it began (few groups whose answers differ in reward, so little gradient).
      cookbook tinker_cookbook.recipes.math_rl.train base_url="$url" model_name="$model" \
        renderer_name=role_colon env=arithmetic group_size=4 groups_per_batch=8 max_tokens=16 \
        learning_rate=3e-4 lora_rank=32 loss_fn=importance_sampling max_steps=40 save_every=8 \
        log_path="$work/math_rl" behavior_if_log_dir_exists=delete
      keys=(env/all/reward/total env/all/correct env/all/format) ;;
    math_rl_default.seed*)
      # Issue 24 item 6: the same command line without loss_fn, so the recipe trains with its own
      # default, stable_reinforce, for 24 iterations. The arithmetic task makes the same problems
      # whatever the seed (it seeds each batch by its index); the runs differ in what vLLM samples.
      cookbook tinker_cookbook.recipes.math_rl.train base_url="$url" model_name="$model" \
        renderer_name=role_colon env=arithmetic group_size=4 groups_per_batch=8 max_tokens=16 \
        learning_rate=3e-4 lora_rank=32 max_steps=24 save_every=8 seed="${recipe#*.seed}" \
        log_path="$work/$recipe" behavior_if_log_dir_exists=delete
      keys=(env/all/reward/total env/all/correct env/all/format) ;;
    chat_sl)
      dataset=$(ls "$repo"/.venv-cookbook/lib/python3*/site-packages/tinker_cookbook/example_data/conversations.jsonl)
      cookbook tinker_cookbook.recipes.chat_sl.train base_url="$url" model_name="$model" \
        renderer_name=role_colon dataset="$dataset" batch_size=8 num_epochs=2 learning_rate=3e-4 \
        lora_rank=32 save_every=16 log_path="$work/chat_sl" behavior_if_log_dir_exists=delete
      keys=(train_mean_nll) ;;
    *) echo "unknown recipe $recipe"; exit 2 ;;
  esac
  echo "$recipe: $(( $(date +%s) - started )) s"
  cp "$work/$recipe/metrics.jsonl" "$out/$recipe.metrics.jsonl"
  .venv/bin/loopline tinker plot "$out/$recipe.metrics.jsonl" ${keys[@]/#/--key } --out "$out/$recipe.png"
done
# The server's view of what ran: one training run per recipe, with its checkpoints.
.venv/bin/loopline --url "$url" tinker runs
