r"""Training-step time of ExGRPO vs on-policy Dr.GRPO on one config, side by side (JSON).

Shown in docs/sampler_performance.md ("Trainer step time").

  python scripts/bench/bench_train.py --config=configs/smollm2_135m.py --config.algo.delayed_start=0

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

  python scripts/bench/bench_train.py --config=configs/smollm2_study.py --variants=exgrpo \
      --schedulers=static,continuous --config.rollout.max_rows=4

With `--baseline=key=value,...` every run also runs as `<run>/baseline`, the config with
those overrides (e.g. the settings before a change), interleaved with it, and the JSON
adds `<run>/over_baseline`, the ratios of median step and learner times. Every run
reports the learner's FLOP roofline: the FLOPs of the forward and backward passes over
the real (unpadded) prompt + response tokens of each step, plus the LM head over the
response tokens, at the float32 matmul rate measured in this process on the model's
MLP shape (`learner_roofline_s`, and `update_actor_over_roofline`).
"""

import ast
import copy
import functools
import json
import os
import sys
import tempfile
import time

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags
import numpy as np

# The config files import `configs.common` from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from configs import common  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import sampling  # pylint: disable=g-import-not-at-top
from exgrpo_jax.aot import targets  # pylint: disable=g-import-not-at-top
from exgrpo_jax.training import trainer as trainer_lib  # pylint: disable=g-import-not-at-top

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py",
                                          "Training config file.", lock_config=True)
_VARIANTS = flags.DEFINE_list("variants", ["exgrpo", "onpolicy"], "Variants to compare.")
_SCHEDULERS = flags.DEFINE_list("schedulers", [], "Rollout schedulers to run each variant "
                                "under (default: the config's).")
_STEPS = flags.DEFINE_integer("steps", 3, "Measured steps per variant.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Unmeasured steps per variant (compile).")
_BASELINE = flags.DEFINE_list("baseline", [], "key=value config overrides: also run every "
                              "variant with them, as <run>/baseline.")

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


def _overrides(items: list[str], config) -> dict:
  """{dotted key: value} from `--baseline`'s key=value items, typed as the config's."""
  out = {}
  for item in items:
    key, sep, text = item.partition("=")
    try:
      current = functools.reduce(lambda node, part: node[part], key.split("."), config)
    except (KeyError, AttributeError, TypeError):
      raise app.UsageError(f"--baseline: {key!r} is not a config key") from None
    if not sep:
      raise app.UsageError(f"--baseline: {item!r} is not key=value")
    try:
      value = type(current)(ast.literal_eval(text)) if not isinstance(current, str) else text
    except (ValueError, SyntaxError):
      raise app.UsageError(f"--baseline: {key}={text!r} is not a {type(current).__name__}") from None
    out[key] = value
  return out


def _set(config, key: str, value) -> None:
  *sections, name = key.split(".")
  functools.reduce(lambda node, part: node[part], sections, config)[name] = value


def _learner_flops(params, groups) -> float:
  """Forward + backward FLOPs (3x the forward's 2 per parameter per token) of the
  learner over the groups' real tokens: every layer over prompt + response, the LM head
  (tied or not: D x V) over the response tokens the loss scores. Attention's score
  matmuls are left out (under 2% at these lengths)."""
  layers = sum(x.size for x in jax.tree.leaves(params["layers"]))
  head = params["embed"].size
  tokens = [(len(g.prompt_ids), len(r.tokens)) for g in groups for r in g.responses]
  return 6.0 * sum(layers * (p + r) + head * r for p, r in tokens)


def _recording_update(trainer, flops: list) -> None:
  """Makes `trainer.actor.update` record each step's learner FLOPs in `flops`."""
  update = trainer.actor.update

  @functools.wraps(update)
  def recorded(params, opt_state, groups, *args):
    flops.append(_learner_flops(params, groups))
    return update(params, opt_state, groups, *args)
  trainer.actor.update = recorded


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
  baseline = _overrides(_BASELINE.value, _CONFIG.value)
  total = _WARMUP.value + _STEPS.value
  runs = [(v, s, b) for v in _VARIANTS.value for s in _SCHEDULERS.value or [None]
          for b in ((False, True) if baseline else (False,))]

  def name(variant, scheduler, is_baseline):
    parts = [variant] + ([scheduler] if scheduler else []) + (["baseline"] if is_baseline else [])
    return "/".join(parts)
  trainers, rows, flops = {}, {name(*run): [] for run in runs}, {}
  with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
    for variant, scheduler, is_baseline in runs:
      config = common.apply_variant(copy.deepcopy(_CONFIG.value), variant)
      if scheduler is not None:
        config.rollout.scheduler = scheduler
        config.rollout.max_rows = max_rows
      for key, value in (baseline.items() if is_baseline else ()):
        _set(config, key, value)
      config.train.steps = total
      config.train.checkpoint_every = total + 1
      config.eval.every = 0
      run = name(variant, scheduler, is_baseline)
      trainers[run] = trainer_lib.Trainer(config, os.path.join(tmp, run.replace("/", "_")))
      flops[run] = []
      _recording_update(trainers[run], flops[run])
    for step in range(1, total + 1):
      for run, trainer in trainers.items():
        t, compile_s = time.time(), _sampler_compile_s(trainer)
        metrics = _without_compile(trainer.train_step(), _sampler_compile_s(trainer) - compile_s)
        print(f"[bench_train] {run} step {step}/{total}: {time.time() - t:.1f} s "
              f"(replayed {metrics['experience/batch_size']}; sampler compile "
              f"{metrics['sampler_compile_s']:.1f} s)", file=sys.stderr, flush=True)
        if step > _WARMUP.value:
          rows[run].append(dict(metrics, learner_flops=flops[run][-1]))
    model_cfg = next(iter(trainers.values())).state.model_cfg
    rate, _ = targets.measured_rates(model_cfg.hidden_size, model_cfg.intermediate_size)
    for trainer in trainers.values():
      trainer.close()

  result = {"config": _CONFIG.value.model.path or "SmolLM2-135M-Instruct (embedded)",
            "train_path": _CONFIG.value.data.train_path,
            "batch_questions": _CONFIG.value.train.batch_questions,
            "k": _CONFIG.value.rollout.k, "max_new_tokens": _CONFIG.value.rollout.max_new_tokens,
            "max_rows": max_rows, "baseline": baseline,
            "warmup_steps": _WARMUP.value, "measured_steps": _STEPS.value,
            "timing": "median seconds per step after warm-up (compile excluded)",
            "matmul_gflops_per_s": rate / 1e9}
  for run, metrics in rows.items():
    roofline_s = float(np.median([m["learner_flops"] for m in metrics])) / rate
    result[run] = {
        **{p: float(np.median([m[f"timing_s/{p}"] for m in metrics])) for p in PHASES},
        "learner_roofline_s": roofline_s,
        "update_actor_over_roofline": float(np.median(
            [m["timing_s/update_actor"] for m in metrics])) / roofline_s,
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
  for run in [r for r in rows if not r.endswith("/baseline")] if baseline else ():
    new, old = result[run], result[f"{run}/baseline"]
    result[f"{run}/over_baseline"] = {p: new[p] / old[p] for p in ("step", "update_actor")}
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  app.run(main)
