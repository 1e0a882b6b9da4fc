"""A study's analysis under its rules: paired statistics, the verdict, the figures.

  result = report.report(config, protocol.read_summaries(directory))
  report.plot(config, result, out_dir)      # <name>_accuracy / _paired / _dynamics.png

For every run: arm, seed, commit, held-out avg@2 and greedy accuracy at each evaluation,
AUC (mean avg@2 over the config's `eval_steps`) and health figures. The paired
comparisons (AUC of one arm minus another's, seed by seed: mean, SD, 95% t interval,
two-sided t-test and Wilcoxon p-values, seeds for / against) of the primary pair (or its
fallback, once that has runs), of the attribution arms on stage 1's seeds and of the
exploratory arms; the rules' checks and the verdict (none where the config's
`verdict.exgrpo` is false: a study of no ExGRPO claim). Needs scipy (the `test` extra).
"""

import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from exgrpo_jax.study import protocol  # pylint: disable=wrong-import-position


def by_arm(config, summaries: dict) -> dict:
  """{arm: {seed: summary}} in the config's arm order; the step-0 evaluation from the
  seed's run of the arm's on-policy counterpart (the fallback's for fallback arms)."""
  runs = {}
  for (arm, seed), run in summaries.items():
    runs.setdefault(arm, {})[seed] = run
  order = list(protocol.arms(config))
  for arm, seeds in runs.items():
    base = runs.get(config.fallback[1] if arm in config.fallback else config.primary[1], {})
    for seed, run in seeds.items():
      if "0" not in run["evals"] and seed in base and "0" in base[seed]["evals"]:
        run["evals"]["0"] = base[seed]["evals"]["0"]
  return dict(sorted(runs.items(), key=lambda kv: order.index(kv[0])))


def _ci95(d: np.ndarray) -> list[float]:
  """The 95% t interval of the mean of `d` (two or more values)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)))
  return [float(d.mean()) - half, float(d.mean()) + half]


def paired(config, runs: dict, a: str, b: str, seeds=None) -> dict | None:
  """AUC(a) - AUC(b) by seed, with its tests, and the held-out avg@2 difference at each
  evaluation step (`by_step`: mean and 95% CI); None where no seed has both."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  common = sorted(set(runs.get(a, {})) & set(runs.get(b, {})) & set(seeds or range(1, 99)))
  if not common:
    return None
  d = np.array([protocol.auc(runs[a][s], config.eval_steps)
                - protocol.auc(runs[b][s], config.eval_steps) for s in common])
  out = {"pair": f"{a} - {b}", "seeds": common, "d": d.tolist(), "n": len(d),
         "mean": float(d.mean()), "for": int((d > 0).sum()), "against": int((d < 0).sum())}
  if len(d) > 1:
    sd = float(d.std(ddof=1))
    out.update(sd=sd, ci95=_ci95(d),
               t_p=float(stats.ttest_1samp(d, 0.0).pvalue) if sd > 0 else None,
               wilcoxon_p=float(stats.wilcoxon(d).pvalue) if np.any(d != 0) else None)
  by_step = {}
  for step in map(str, config.eval_steps):
    at = np.array([runs[a][s]["evals"][step]["avg@2"] - runs[b][s]["evals"][step]["avg@2"]
                   for s in common])
    by_step[step] = {"mean": float(at.mean())} | ({"ci95": _ci95(at)} if len(at) > 1 else {})
  out["by_step"] = by_step
  return out


def tuning(config, summaries: dict, runs: dict) -> dict | None:
  """The tuning's candidates (mean AUC over its seeds, whether a run collapsed, the
  paired difference from the primary pair's second arm there) and its winner; None
  without a tuning section."""
  t = config.get("tuning")
  if not t:
    return None
  candidates = {}
  for arm in t.arms:
    done = [runs[arm][s] for s in t.seeds if s in runs.get(arm, {})]
    if done:
      candidates[arm] = dict(
          seeds=[s for s in t.seeds if s in runs[arm]],
          auc=float(np.mean([protocol.auc(r, config.eval_steps) for r in done])),
          collapsed=any(protocol.collapsed(r, config) for r in done),
          vs=paired(config, runs, arm, config.primary[1], t.seeds))
  return dict(seeds=list(t.seeds), tie=t.tie, candidates=candidates,
              winner=protocol.tuned(config, summaries))


def verdict(config, runs: dict, primary: dict | None, pairs: tuple) -> dict:
  """The pre-registered rules applied to the finished runs."""
  a, b = pairs
  rules, n_first = config.verdict, len(config.stages[0])
  n_all = len(protocol.stage_seeds(config))
  gains = {arm: float(np.mean([protocol.auc(r, config.eval_steps) - r["evals"]["0"]["avg@2"]
                               for r in seeds.values() if "0" in r["evals"]]))
           for arm, seeds in runs.items()}
  out = {"pairs": f"{a} - {b}", "manipulation_gain": gains,
         "manipulation_check": any(g >= rules.manipulation for g in gains.values())}
  first = [runs[a][s] for s in sorted(runs.get(a, {}))]
  passing = sum(protocol.healthy(r, config.health) for r in first)
  out["healthy"] = f"{passing} of {len(first)}"
  common = sorted(set(runs.get(a, {})) & set(runs.get(b, {})))
  fewer = sum(runs[a][s]["zero_advantage_share"] < runs[b][s]["zero_advantage_share"]
              for s in common)
  out["fewer_zero_advantage_pairs"] = f"{fewer} of {len(common)}"
  if not out["manipulation_check"]:
    out["verdict"] = (f"too hard at this budget: no arm gained {100 * rules.manipulation:.0f} "
                      "points of AUC over step 0")
  elif primary is None or "ci95" not in primary:
    out["verdict"] = "pending: too few paired seeds"
  elif len(common) == n_first and primary["sd"] > config.max_sd:
    out["verdict"] = (f"not resolvable at this budget: paired SD {100 * primary['sd']:.1f} "
                      f"points after stage 1, 95% CI {100 * primary['ci95'][0]:+.1f} to "
                      f"{100 * primary['ci95'][1]:+.1f}")
  elif len(common) < n_all:
    out["verdict"] = f"pending: {len(common)} of {n_all} pairs"
  elif (primary["mean"] > 0 and primary["t_p"] < 0.05
        and passing >= config.health.min_healthy and fewer >= rules.support_pairs):
    out["verdict"] = "support: ExGRPO beats on-policy, by the mechanism's figures too"
  elif primary["ci95"][1] < rules.rescue:
    out["verdict"] = (f"no rescue-sized effect: the upper 95% bound "
                      f"{100 * primary['ci95'][1]:+.1f} points is below "
                      f"{100 * rules.rescue:+.0f}")
  else:
    out["verdict"] = "inconclusive"
  return out


def arm_summary(config, seeds: dict) -> dict:
  """Per arm, over its seeds: collapses (greedy accuracy at the last evaluation at least
  `verdict.collapse` below step 0), and the means of its dynamics at the evaluation steps
  (entropy, response length, ratio maxima, grad norm, buffered, retired) and over the run
  (replayed questions a step, zero-advantage share)."""
  runs, last = list(seeds.values()), str(max(config.eval_steps))
  at = lambda name: {str(s): float(np.mean([r["curves"][name][s - 1] for r in runs]))
                     for s in config.eval_steps}
  return dict(
      seeds=sorted(seeds), auc=float(np.mean([protocol.auc(r, config.eval_steps)
                                              for r in runs])),
      collapses=sum(r["evals"][last]["greedy"] <= r["evals"]["0"]["greedy"]
                    - config.verdict.collapse for r in runs if "0" in r["evals"]),
      zero_advantage_share=float(np.mean([r["zero_advantage_share"] for r in runs])),
      replayed_per_step=float(np.mean([np.mean(r["curves"]["replayed"]) for r in runs])),
      **{name: at(name) for name in ("entropy", "length", "on_ratio_max", "off_ratio_max",
                                     "grad_norm", "buffered", "retired")})


def report(config, summaries: dict) -> dict:
  """The report's JSON (its `_runs` key: {arm: {seed: summary}}, for the figures)."""
  runs = by_arm(config, summaries)
  pairs = protocol.reported_pair(config, runs)
  primary = paired(config, runs, *pairs)
  attribution = [p for arm in config.attribution for other in config.primary
                 if (p := paired(config, runs, arm, other, config.stages[0]))]
  exploratory = [p for arm in config.exploratory for other in config.primary
                 if (p := paired(config, runs, arm, other))]
  table = [{k: v for k, v in r.items() if k != "curves"}
           | {"auc": protocol.auc(r, config.eval_steps)}
           for seeds in runs.values() for r in seeds.values()]
  chosen = tuning(config, summaries, runs)
  return {"protocol": config.protocol, "config": config.train_config, "runs": table,
          **({"tuning": chosen} if chosen else {}),
          "primary": primary, "attribution": attribution, "exploratory": exploratory,
          "arms": {arm: arm_summary(config, seeds) for arm, seeds in runs.items()},
          "rules": verdict(config, runs, primary, pairs) if config.verdict.exgrpo else None,
          "_runs": runs}


def plot(config, result: dict, out_dir: str) -> list[str]:
  """The held-out curves per arm (one line per seed), the paired AUC differences per seed
  and the dynamics per step; their paths."""
  runs, paths, name = result["_runs"], [], config.name
  colors = {arm: f"C{i}" for i, arm in enumerate(protocol.arms(config))}
  os.makedirs(out_dir, exist_ok=True)
  tuned = config.get("tuning")
  if tuned:  # the tuning's candidates and the confirmation's arms, each on its own seeds
    later = [a for a in runs if a not in tuned.arms]
    panels = [("avg@2", [*tuned.arms, config.primary[1]], tuned.seeds, "tuning"),
              ("avg@2", later, protocol.stage_seeds(config), "confirmation")]
  else:
    panels = [(score, list(runs), None, None) for score in ("avg@2", "greedy")]
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, (score, arms, only, title) in zip(axes, panels):
    for arm in arms:
      seeds = {s: r for s, r in runs.get(arm, {}).items() if only is None or s in only}
      for i, run in enumerate(seeds.values()):
        steps = sorted(map(int, run["evals"]))
        ax.plot(steps, [100 * run["evals"][str(s)][score] for s in steps], color=colors[arm],
                alpha=0.35, marker=".", label=arm if i == 0 else None)
      steps = sorted({int(s) for r in seeds.values() for s in r["evals"]})
      mean = [np.mean([100 * r["evals"][str(s)][score] for r in seeds.values()
                       if str(s) in r["evals"]]) for s in steps]
      ax.plot(steps, mean, color=colors[arm], linewidth=2.5)
    where = f"{title}, seeds {', '.join(map(str, only))}: " if title else ""
    ax.set_title(f"{where}held-out {score} (%), seeds thin, mean thick", fontsize=10)
  paths.append(save_figure(fig, axes, out_dir, f"{name}_accuracy.png"))
  comparisons = [p for p in [result["primary"], *result["attribution"]] if p] + [
      p | {"pair": f"{p['pair']} (exploratory)"} for p in result["exploratory"]]
  fig, ax = plt.subplots(figsize=(7, 4))
  for i, p in enumerate(comparisons):
    ax.scatter([i] * p["n"], 100 * np.array(p["d"]), color="C0")
    ax.errorbar([i + 0.15], [100 * p["mean"]], fmt="o", color="k", capsize=4, yerr=None
                if "ci95" not in p else [[100 * (p["mean"] - p["ci95"][0])],
                                         [100 * (p["ci95"][1] - p["mean"])]])
  ax.axhline(0, color="gray", linewidth=1)
  ax.set_xlim(-0.5, len(comparisons) - 0.3)
  ax.set_xticks(range(len(comparisons)), [p["pair"] for p in comparisons], fontsize=7,
                rotation=15)
  ax.set_title("paired AUC difference (points): seeds, mean and 95% CI", fontsize=10)
  paths.append(save_figure(fig, [ax], out_dir, f"{name}_paired.png", per_step=False))
  names = ("entropy", "length", "on_ratio_max", "off_ratio_max", "grad_norm", "buffered",
           "replayed", "fresh_solved", "solve_none")
  fig, axes = plt.subplots(3, 3, figsize=(14, 10))
  for ax, curve_name in zip(axes.flat, names):
    for arm, seeds in runs.items():
      curve = np.mean([r["curves"][curve_name] for r in seeds.values()], axis=0)
      ax.plot(np.arange(1, len(curve) + 1), curve, color=colors[arm], label=arm)
    ax.set_title(f"{curve_name}, mean over seeds", fontsize=10)
  paths.append(save_figure(fig, axes.flat, out_dir, f"{name}_dynamics.png"))
  return paths


def save_figure(fig, axes, out_dir: str, name: str, per_step: bool = True) -> str:
  """Writes `fig` to out_dir/name; `per_step` axes get a step label and a legend."""
  for ax in axes:
    ax.grid(alpha=0.3)
    if per_step:
      ax.set_xlabel("training step")
      ax.legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(out_dir, name)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
