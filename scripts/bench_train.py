r"""Training-step time of ExGRPO vs on-policy Dr.GRPO on one config, side by side (JSON).

  python scripts/bench_train.py --config=configs/smollm2_135m.py --config.algo.delayed_start=0

Builds one trainer per variant (`--variants`, default exgrpo,onpolicy) in fresh temporary
workdirs and runs their steps interleaved (exgrpo step 1, onpolicy step 1, exgrpo step
2, ...), so machine load hits both alike. The first `--warmup` steps are compile and
buffer warm-up and are excluded; the rest report the median of each phase the trainer
times: `select` (replay sampling and lowest-entropy selection under the current
policy), `gen` (rollout), `reward`, `buffer`, `old_logprobs` (recomputed pi_old, zero
when the rollout's temperature-1 log-probs are used) and `update_actor` (the jitted
mini-batch steps), plus the whole step. `exgrpo_over_onpolicy` is the ratio of median
step times (the paper measured 1.19; our target is <= 1.10). Rollout programs compiled
after the warm-up (shapes first met later) are subtracted from `gen` and the step, and
listed per step. With a real model, make
sure replay is active (a task the model partly solves, and `algo.delayed_start` low):
the JSON reports how many replayed questions each variant had per step.

With `--schedulers=static,continuous` every variant runs under each rollout scheduler
(`rollout.scheduler`), and the JSON adds `<variant>/continuous_over_static`, the ratio of
median step times. The comparison needs rows waiting for slots, so `rollout.max_rows`
must be below the rows a step rolls out; a config that leaves it at 0 (every row in one
call, where both schedulers run the static loop) gets a quarter of a step's rows, said
on stderr and recorded in the JSON:

  python scripts/bench_train.py --config=configs/smollm2_study.py --variants=exgrpo \
      --schedulers=static,continuous --config.rollout.max_rows=4
"""

import copy
import json
import os
import sys
import tempfile
import time

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags
import numpy as np

# The config files import `configs.common` from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import common  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import sampling  # pylint: disable=g-import-not-at-top
from exgrpo_jax.training import trainer as trainer_lib  # pylint: disable=g-import-not-at-top

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py",
                                          "Training config file.", lock_config=True)
_VARIANTS = flags.DEFINE_list("variants", ["exgrpo", "onpolicy"], "Variants to compare.")
_SCHEDULERS = flags.DEFINE_list("schedulers", [], "Rollout schedulers to run each variant "
                                "under (default: the config's).")
_STEPS = flags.DEFINE_integer("steps", 3, "Measured steps per variant.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Unmeasured steps per variant (compile).")

PHASES = ("select", "gen", "reward", "buffer", "old_logprobs", "update_actor", "step")


def _sampler_compile_s(trainer) -> float:
  """Seconds the rollout engine has spent compiling (0 for engines that do not say)."""
  return getattr(trainer.engine, "stats", {}).get("compile_s", 0.0)


def _without_compile(metrics, compile_s: float):
  """A step's metrics less the rollout programs it compiled (a shape first met after the
  warm-up: a continuous rollout's slot count or page pool size), which ran in `gen`."""
  gen = metrics["timing_s/gen"]
  return {**metrics, "sampler_compile_s": compile_s,
          "timing_s/gen": gen - compile_s, "timing_s/step": metrics["timing_s/step"] - compile_s,
          "timing_s/tokens_per_s": metrics["timing_s/tokens_per_s"] * gen / (gen - compile_s)}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # Orbax's INFO lines would bury the progress
  if _STEPS.value < 1 or _WARMUP.value < 0:
    raise app.UsageError("--steps must be >= 1 and --warmup >= 0")
  unknown = [v for v in _VARIANTS.value if v not in common.VARIANTS]
  if unknown:
    raise app.UsageError(f"--variants: unknown {', '.join(unknown)}; choose from "
                         f"{', '.join(common.VARIANTS)}")
  unknown = [s for s in _SCHEDULERS.value if s not in sampling.SCHEDULERS]
  if unknown:
    raise app.UsageError(f"--schedulers: unknown {', '.join(unknown)}; choose from "
                         f"{', '.join(sampling.SCHEDULERS)}")
  max_rows = _CONFIG.value.rollout.max_rows
  if _SCHEDULERS.value and not max_rows:
    rows = _CONFIG.value.train.batch_questions * _CONFIG.value.rollout.k
    max_rows = max(rows // 4, 1)
    print(f"[bench_train] --schedulers: rollout.max_rows=0 rolls every row out in one call, "
          f"where both schedulers run the static loop; using max_rows={max_rows}, a quarter "
          f"of the {rows} rows a step rolls out (set --config.rollout.max_rows to choose)",
          file=sys.stderr, flush=True)
  total = _WARMUP.value + _STEPS.value
  runs = [(v, s) for v in _VARIANTS.value for s in _SCHEDULERS.value or [None]]
  name = lambda variant, scheduler: variant if scheduler is None else f"{variant}/{scheduler}"
  trainers, rows = {}, {name(*run): [] for run in runs}
  with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
    for variant, scheduler in runs:
      config = common.apply_variant(copy.deepcopy(_CONFIG.value), variant)
      if scheduler is not None:
        config.rollout.scheduler = scheduler
        config.rollout.max_rows = max_rows
      config.train.steps = total
      config.train.checkpoint_every = total + 1
      config.eval.every = 0
      run = name(variant, scheduler)
      trainers[run] = trainer_lib.Trainer(config, os.path.join(tmp, run.replace("/", "_")))
    for step in range(1, total + 1):
      for run, trainer in trainers.items():
        t, compile_s = time.time(), _sampler_compile_s(trainer)
        metrics = _without_compile(trainer.train_step(), _sampler_compile_s(trainer) - compile_s)
        print(f"[bench_train] {run} step {step}/{total}: {time.time() - t:.1f} s "
              f"(replayed {metrics['experience/batch_size']}; sampler compile "
              f"{metrics['sampler_compile_s']:.1f} s)", file=sys.stderr, flush=True)
        if step > _WARMUP.value:
          rows[run].append(metrics)
    for trainer in trainers.values():
      trainer.close()

  result = {"config": _CONFIG.value.model.path or "SmolLM2-135M-Instruct (embedded)",
            "train_path": _CONFIG.value.data.train_path,
            "batch_questions": _CONFIG.value.train.batch_questions,
            "k": _CONFIG.value.rollout.k, "max_new_tokens": _CONFIG.value.rollout.max_new_tokens,
            "max_rows": max_rows,
            "warmup_steps": _WARMUP.value, "measured_steps": _STEPS.value,
            "timing": "median seconds per step after warm-up (compile excluded)"}
  for run, metrics in rows.items():
    result[run] = {
        **{p: float(np.median([m[f"timing_s/{p}"] for m in metrics])) for p in PHASES},
        "replayed_questions_per_step": [int(m["experience/batch_size"]) for m in metrics],
        "generated_tokens_per_s": float(np.median([m["timing_s/tokens_per_s"]
                                                   for m in metrics])),
        "sampler_compile_s_per_step": [round(m["sampler_compile_s"], 2) for m in metrics],
    }
  if {"exgrpo", "onpolicy"} <= set(rows):
    result["exgrpo_over_onpolicy"] = result["exgrpo"]["step"] / result["onpolicy"]["step"]
  if {"static", "continuous"} <= set(_SCHEDULERS.value):
    for variant in _VARIANTS.value:
      result[f"{variant}/continuous_over_static"] = (result[f"{variant}/continuous"]["step"]
                                                     / result[f"{variant}/static"]["step"])
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  app.run(main)
