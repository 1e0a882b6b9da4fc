#!/usr/bin/env bash
# The small-scale study of docs/results.md, end to end: base accuracy, every run,
# the summary table and the plots.
#
#   bash scripts/reproduce_small.sh                 # all runs (about 2 h on 2 CPU cores)
#   SEEDS="1" bash scripts/reproduce_small.sh       # one seed per method
#
# Interrupt it at any time and run it again: finished runs are skipped (their workdir
# holds the final checkpoint) and an unfinished one resumes from its latest checkpoint.
# Runs go seed by seed (on-policy, ExGRPO, then the ablations), so a partial study is
# still balanced across methods.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
OUT=${OUT:-runs/study}
SEEDS=${SEEDS:-"1 2 3"}
ABLATION_SEEDS=${ABLATION_SEEDS:-"1"}
CONFIG=configs/smollm2_arith.py
mkdir -p "$OUT"

# Base accuracy: the same 100 held-out problems and greedy decoding as the runs' eval
# (the config's generated task, configs/smollm2_arith.py STUDY_TASK).
if [ ! -f "$OUT/base_eval.json" ]; then
  TASK=$("$PYTHON" -c "from configs import smollm2_arith; print(smollm2_arith.STUDY_TASK)")
  "$PYTHON" -m exgrpo_jax.eval --data "arithmetic:$TASK" --limit 25 --max-new-tokens 64 \
    --max-prompt-tokens 128 --temperature 0 --out "$OUT/base_eval.json"
fi

run() {  # run METHOD SEED
  echo "=== $1 seed $2 ==="
  "$PYTHON" -m exgrpo_jax.train --config="$CONFIG:$1" --config.train.seed="$2" \
    --workdir="$OUT/$1_s$2"
}

for seed in $SEEDS; do
  run onpolicy "$seed"
  run exgrpo "$seed"
  if [[ " $ABLATION_SEEDS " == *" $seed "* ]]; then
    run no_shaping "$seed"
    run no_tsel "$seed"
  fi
done

for workdir in "$OUT"/*_s*/; do
  "$PYTHON" scripts/plot_run.py --workdir "$workdir"
done
"$PYTHON" scripts/summarize_study.py --study "$OUT"
