"""A study's rules: its config, its finished runs' summaries, and what runs next.

  config = protocol.load("configs/study_v3.py", smoke=False)
  runs = protocol.read_summaries(summaries_dir)     # {(arm, seed): summary}
  todo, state = protocol.plan(config, runs, exploratory=False)

A study config (configs/study_v3.py) names the arms (a variant of its training config
and overrides each), the seeds of each stage, the primary pair and its fallback, the
attribution and exploratory arms, the evaluation steps of the AUC and the health and
stage rules. `plan` applies them to the finished runs only: stage 1 runs every primary
and attribution arm seed by seed; above `max_sd` (the SD of stage 1's paired AUC
differences) the study stops; otherwise the later stages run the primary pair. Unless
`health.min_healthy` of the primary pair's first-arm runs pass the replay health check,
the fallback pair reruns by the same stages. Exploratory arms come last, on stage 1's
seeds, only when asked for.

A config with a `tuning` section first runs its candidate arms (and the primary pair's
second arm) on the tuning seeds and picks the candidate of the best mean AUC (within
`tuning.tie` of it, the one listed first; a candidate with a collapsed run is never
picked). An arm whose overrides hold `@tuned` takes the winner's overrides there, so the
later stages confirm the chosen setting on seeds of their own.
"""

import glob
import json
import os
import re

import numpy as np

from exgrpo_jax import cli
from exgrpo_jax import config_cli

SUMMARY = re.compile(r"(.+)_s(\d+)\.json")
# What the report reads from every summary; a summary without them is not one.
SUMMARY_KEYS = ("arm", "seed", "evals", "health", "zero_advantage_share", "curves")
TUNED = "@tuned"  # in an arm's overrides: the tuning winner's overrides


def load(path: str, smoke: bool = False):
  """The study config of file `path` (its "smoke" variant with `smoke`); a bad file, or
  a seed or arm of its rules that no run could have, is a UsageError naming it."""
  spec = f"{path}:smoke" if smoke and ":" not in path else path
  problem = config_cli.config_problem([f"--config={spec}"])
  if problem:
    raise cli.UsageError(problem)
  config = config_cli.load(spec)
  missing = [k for k in ("name", "train_config", "arms", "primary", "stages", "eval_steps")
             if k not in config]
  if missing:
    raise cli.UsageError(f"--config={spec}: not a study config (no {', '.join(missing)})")
  problem = _problem(config)
  if problem:
    raise cli.UsageError(f"--config={spec}: {problem}")
  return config


def _problem(config) -> str | None:
  """What is wrong with a study config's seeds and arms ("KEY: VALUE ..."), or None."""
  names = [arm for arm, _, _ in config.arms]
  tuning = config.get("tuning")
  for arm, _, overrides in config.arms:
    if TUNED in overrides and not tuning:
      return f"arm {arm!r} takes {TUNED} but the config has no tuning section"

  def arms_problem(key, arms):
    bad = next((a for a in arms if a not in names), None)
    return bad and f"{key}: {bad!r} is not an arm (arms: {', '.join(names)})"

  def seeds_problem(key, seeds):
    if not seeds:
      return f"{key}={tuple(seeds)!r}: must list at least one seed"
    bad = next((s for s in seeds if not isinstance(s, int) or isinstance(s, bool) or s < 0),
               None)
    return bad is not None and f"{key}: {bad!r} is not a seed (a whole number >= 0: the " \
        "runs' train.seed)"

  for key in ("primary", "fallback"):
    if len(config[key]) != 2:
      return f"{key}={tuple(config[key])!r}: must be a pair of two arms"
  if not config.stages:
    return f"stages={tuple(config.stages)!r}: must list at least one stage of seeds"
  seen = set()
  for i, seeds in enumerate(config.stages):
    problem = seeds_problem(f"stages[{i}]", seeds)
    if problem:
      return problem
    again = next((s for s in seeds if s in seen), None)
    if again is not None:
      return f"stages: seed {again} is in more than one stage (each seed's runs count once)"
    seen.update(seeds)
  problems = [arms_problem(key, config[key])
              for key in ("primary", "fallback", "attribution", "exploratory")]
  if tuning:
    if not tuning.arms:
      problems.append(f"tuning.arms={tuple(tuning.arms)!r}: must list at least one "
                      "candidate arm")
    problems += [arms_problem("tuning.arms", tuning.arms),
                 seeds_problem("tuning.seeds", tuning.seeds)]
    tie = tuning.tie
    if not isinstance(tie, (int, float)) or isinstance(tie, bool) or not tie >= 0:
      problems.append(f"tuning.tie={tie!r}: must be a number >= 0 (an AUC difference)")
  return next((p for p in problems if p), None)


def arms(config) -> dict:
  """{arm: (variant of the training config, its own `key=value` overrides)}, in order."""
  return {name: (variant, tuple(overrides)) for name, variant, overrides in config.arms}


def auc(run: dict, eval_steps) -> float:
  """Mean held-out avg@2 over the evaluation steps."""
  return float(np.mean([run["evals"][str(s)]["avg@2"] for s in eval_steps]))


def collapsed(run: dict, config) -> bool:
  """Greedy accuracy at the last evaluation `verdict.collapse` or more below step 0's."""
  evals = run["evals"]
  return "0" in evals and (evals[str(max(config.eval_steps))]["greedy"]
                           <= evals["0"]["greedy"] - config.verdict.collapse)


def tuned(config, runs: dict) -> str | None:
  """The tuning's winning arm; None without tuning, before its runs have all finished,
  or where every candidate collapsed."""
  tuning = config.get("tuning")
  if not tuning or _todo(runs, [(a, s) for a in tuning.arms for s in tuning.seeds]):
    return None
  scores = {arm: float(np.mean([auc(runs[arm, s], config.eval_steps) for s in tuning.seeds]))
            for arm in tuning.arms
            if not any(collapsed(runs[arm, s], config) for s in tuning.seeds)}
  best = max(scores.values(), default=None)
  return next((arm for arm in scores if scores[arm] >= best - tuning.tie), None)


def resolve(config, runs: dict):
  """`config` with `@tuned` in the arms' overrides replaced by the winner's overrides, a
  later value of a key replacing an earlier one (itself until the tuning has a winner)."""
  winner = tuned(config, runs)
  if winner is None:
    return config
  chosen = arms(config)[winner][1]

  def expand(overrides):
    settings = {}
    for kv in (kv for o in overrides for kv in (chosen if o == TUNED else (o,))):
      key, value = kv.split("=", 1)
      settings.pop(key, None)
      settings[key] = value
    return tuple(f"{k}={v}" for k, v in settings.items())
  resolved = config.copy_and_resolve_references()
  with resolved.unlocked():
    resolved.arms = tuple((arm, variant, expand(overrides))
                          for arm, variant, overrides in config.arms)
  return resolved


def healthy(run: dict, health) -> bool:
  h = run["health"]
  return (h["buffered_at_10"] >= health.min_buffered
          and h["replay_share_11_40"] <= health.max_replay_share)


def read_summary(path: str) -> dict:
  """One run's summary; a damaged one (cut short, not a summary) is a UsageError naming
  the file and what is wrong."""
  try:
    with open(path, encoding="utf-8") as f:
      run = json.load(f)
  except json.JSONDecodeError as e:
    raise cli.UsageError(f"{path}: damaged run summary ({e.msg}, line {e.lineno} column "
                         f"{e.colno}); move it aside to rerun that run") from None
  except (OSError, UnicodeDecodeError) as e:
    raise cli.UsageError(f"{path}: unreadable run summary ({cli.one_line(e)})") from None
  missing = [k for k in SUMMARY_KEYS if not isinstance(run, dict) or k not in run]
  if missing:
    raise cli.UsageError(f"{path}: not a run summary (no {', '.join(missing)}); move it "
                         "aside to rerun that run")
  return run


def read_summaries(directory: str) -> dict:
  """{(arm, seed): summary} of `<directory>/<arm>_s<seed>.json`; none where it is absent."""
  runs = {}
  for path in sorted(glob.glob(os.path.join(directory, "*_s*.json"))):
    match = SUMMARY.fullmatch(os.path.basename(path))
    if match:
      runs[match[1], int(match[2])] = read_summary(path)
  return runs


def reported_pair(config, arms) -> tuple:
  """The pair the report compares, given the `arms` that have runs: the fallback once it
  has runs, else the primary."""
  return tuple(config.fallback if config.fallback[0] in arms else config.primary)


def unpaired(config, runs: dict) -> str | None:
  """Why the finished `runs` give the report no paired result (no run of an arm of its
  pair, or no seed with runs of both), or None."""
  seeds = {}
  for arm, seed in sorted(runs):
    seeds.setdefault(arm, []).append(seed)
  pair = reported_pair(config, seeds)
  name = "fallback" if pair == tuple(config.fallback) != tuple(config.primary) else "primary"
  for arm, which in zip(pair, ("first", "second")):
    if arm not in seeds:
      return (f"no run of {arm}, the {name} pair's {which} arm (arms there: "
              f"{', '.join(seeds)})")
  if not set(seeds[pair[0]]) & set(seeds[pair[1]]):
    return (f"no seed with runs of both {pair[0]} and {pair[1]} "
            + "(" + "; ".join(f"{a}: {', '.join(map(str, seeds[a]))}" for a in pair) + ")")
  return None


def paired_sd(config, runs: dict, arms, seeds) -> float | None:
  """SD of the paired AUC differences, None until every pair has finished (or with one)."""
  if len(seeds) < 2 or any((arm, s) not in runs for s in seeds for arm in arms):
    return None
  return float(np.std([auc(runs[arms[0], s], config.eval_steps)
                       - auc(runs[arms[1], s], config.eval_steps) for s in seeds], ddof=1))


def _todo(runs: dict, wanted) -> list:
  return [r for r in wanted if r not in runs]


def stage_seeds(config) -> list[int]:
  """Every stage's seeds, stage by stage (a seed is in one stage only)."""
  return [s for seeds in config.stages for s in seeds]


def _by_stages(config, runs: dict, pair) -> tuple[list, str | None, str]:
  """The runs of `pair` the stages call for, the stage they belong to, and the state."""
  for i, seeds in enumerate(config.stages):
    todo = _todo(runs, [(arm, s) for s in seeds for arm in pair[::-1]])
    if todo:
      return todo, f"stage {i + 1}", ""
    sd = paired_sd(config, runs, pair, seeds) if i == 0 else None
    if i == 0 and sd is not None and sd > config.max_sd:
      return [], None, (f"stopped after stage 1: paired AUC SD {100 * sd:.1f} > "
                        f"{100 * config.max_sd:.0f} points")
  return [], None, ""


def plan(config, runs: dict, exploratory: bool) -> tuple[list, str]:
  """The (arm, seed) runs the rules call for now, in order, and the study's state."""
  tuning, winner = config.get("tuning"), tuned(config, runs)
  if tuning:
    todo = _todo(runs, [(arm, s) for s in tuning.seeds
                        for arm in (config.primary[1], *tuning.arms)])
    if todo:
      return todo, "tuning"
    if winner is None:
      return [], "stopped after tuning: every candidate collapsed"
  first = config.stages[0]
  todo = _todo(runs, [(arm, s) for s in first
                      for arm in (*config.primary[::-1], *config.attribution)])
  if todo:
    return todo, "stage 1"
  todo, stage, stopped = _by_stages(config, runs, config.primary)
  if stopped:
    return [], stopped
  if todo:
    return todo, stage
  pairs = config.primary
  seeds = stage_seeds(config)
  passing = sum(healthy(runs[config.primary[0], s], config.health) for s in seeds)
  state = (f"done: {passing} of {len(seeds)} ExGRPO runs healthy" if config.verdict.exgrpo
           else "done")
  if passing < config.health.min_healthy:
    pairs = config.fallback
    todo, stage, stopped = _by_stages(config, runs, config.fallback)
    if todo:
      return todo, f"fallback {stage} ({passing} of {len(seeds)} ExGRPO runs healthy)"
    state = "fallback done"
  if exploratory:
    todo = _todo(runs, [(arm, s) for arm in config.exploratory for s in first])
    if todo:
      return todo, "exploratory " + " ".join(config.exploratory)
  chosen = f"; tuned = {winner}" if winner else ""
  return [], f"{state} (pairs {pairs[0]} - {pairs[1]}{chosen})"
