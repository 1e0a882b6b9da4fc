#!/usr/bin/env bash
# The small-scale study of docs/results.md, end to end: base accuracy, every run,
# the summary table and the plots.
#
#   bash scripts/reproduce_small.sh                 # all 16 runs (about 2 h on 2 CPU cores)
#   SEEDS="1" ABLATION_SEEDS="1" bash scripts/reproduce_small.sh   # one seed per method
#   FLAGS="--config.train.steps=2 --config.eval.limit=4" SEEDS=1 ABLATION_SEEDS=1 \
#     OUT=/tmp/study bash scripts/reproduce_small.sh      # a smoke run of the whole pipeline
#
# Interrupt it at any time and run it again: finished runs are skipped (their workdir
# holds the final checkpoint) and an unfinished one resumes from its latest checkpoint.
# Runs go seed by seed (on-policy, ExGRPO, then the ablations), so a partial study is
# still balanced across methods. Seed s means the same training questions, eval
# questions and initial keys in every method: the runs are paired by seed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
OUT=${OUT:-runs/study}
SEEDS=${SEEDS:-"1 2 3 4 5"}
ABLATION_SEEDS=${ABLATION_SEEDS:-"1 2 3"}
read -r -a EXTRA_FLAGS <<< "${FLAGS:-}"  # added to every training run
CONFIG=configs/smollm2_study.py
mkdir -p "$OUT"
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true

run() {  # run METHOD SEED [FLAGS...]
  echo "=== $1 seed $2 ==="
  "$PYTHON" -m exgrpo_jax.train --config="$CONFIG:$1" --config.train.seed="$2" \
    --workdir="$OUT/$1_s$2" "${@:3}" ${EXTRA_FLAGS[@]+"${EXTRA_FLAGS[@]}"}
}

for seed in $SEEDS; do
  # The untrained model's evaluation (step 0) is the same in every method of a seed.
  run onpolicy "$seed" --config.eval.before_train=True
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
