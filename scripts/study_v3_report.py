r"""Evidence v3's analysis under its pre-registered rules (docs/results.md): JSON and figures.

  python scripts/study_v3_report.py [--summaries docs/results/study_v3_runs]
      [--json docs/results/study_v3.json] [--plots docs/results]

Reads every finished run's summary (`<arm>_s<seed>.json`, scripts/study_v3.py writes
them) and
writes, for every run, its arm, seed, commit, held-out avg@2 and greedy accuracy at each
evaluation step, AUC (mean avg@2 over steps 10-40) and health figures; the paired
comparisons (mean, SD, 95% t interval, two-sided t-test and Wilcoxon p-values, seeds
for / against); the rules' checks and the verdict. Needs scipy (the `test` extra).
Figures: `study_v3_accuracy.png` (held-out curves per arm, one line per seed),
`study_v3_paired.png` (paired AUC differences per seed) and `study_v3_dynamics.png`
(entropy, length, ratio maxima, grad norm, buffer and replays per step).
"""

import argparse
import glob
import json
import os
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import study_v3  # pylint: disable=wrong-import-position
from summarize_study import save_figure  # pylint: disable=wrong-import-position

ARM_ORDER = ("onpolicy", "exgrpo", "noreplay", "delayed", "rho50", "onpolicy_b8", "exgrpo_b8")
COLORS = dict(zip(ARM_ORDER, ("C0", "C1", "C2", "C3", "C4", "C5", "C6")))
SUPPORT_PAIRS = 6  # of 8: ExGRPO's zero-advantage share below on-policy's
RESCUE = 0.09      # "no rescue-sized effect" when the upper 95% bound is below this
MANIPULATION = 0.03  # some arm's AUC gain over step 0
COLLAPSE = 0.05      # greedy accuracy lost from step 0 to step 40


def load(summaries: str) -> dict:
  """{arm: {seed: run summary}}; the step-0 evaluation from the seed's on-policy run."""
  runs = {}
  for path in sorted(glob.glob(os.path.join(summaries, "*_s*.json"))):
    with open(path, encoding="utf-8") as f:
      run = json.load(f)
    runs.setdefault(run["arm"], {})[run["seed"]] = run
  for arm, seeds in runs.items():
    base = runs.get("onpolicy_b8" if arm.endswith("_b8") else "onpolicy", {})
    for seed, run in seeds.items():
      if "0" not in run["evals"] and seed in base and "0" in base[seed]["evals"]:
        run["evals"]["0"] = base[seed]["evals"]["0"]
  return dict(sorted(runs.items(), key=lambda kv: ARM_ORDER.index(kv[0])))


def paired(runs: dict, a: str, b: str, seeds=None) -> dict | None:
  """AUC(a) - AUC(b) by seed, with its tests; None where no seed has both."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  common = sorted(set(runs.get(a, {})) & set(runs.get(b, {})) & set(seeds or range(1, 99)))
  if not common:
    return None
  d = np.array([study_v3.auc(runs[a][s]) - study_v3.auc(runs[b][s]) for s in common])
  out = {"pair": f"{a} - {b}", "seeds": common, "d": d.tolist(), "n": len(d),
         "mean": float(d.mean()), "for": int((d > 0).sum()), "against": int((d < 0).sum())}
  if len(d) > 1:
    sd = float(d.std(ddof=1))
    half = float(stats.t.ppf(0.975, len(d) - 1) * sd / np.sqrt(len(d)))
    out.update(sd=sd, ci95=[out["mean"] - half, out["mean"] + half],
               t_p=float(stats.ttest_1samp(d, 0.0).pvalue) if sd > 0 else None,
               wilcoxon_p=float(stats.wilcoxon(d).pvalue) if np.any(d != 0) else None)
  return out


def verdict(runs: dict, primary: dict | None, pairs: tuple) -> dict:
  """The pre-registered rules applied to the finished runs."""
  a, b = pairs
  gains = {arm: float(np.mean([study_v3.auc(r) - r["evals"]["0"]["avg@2"]
                               for r in seeds.values() if "0" in r["evals"]]))
           for arm, seeds in runs.items()}
  out = {"pairs": f"{a} - {b}", "manipulation_gain": gains,
         "manipulation_check": any(g >= MANIPULATION for g in gains.values())}
  exgrpo = [runs[a][s] for s in sorted(runs.get(a, {}))]
  out["healthy"] = f"{sum(map(study_v3.healthy, exgrpo))} of {len(exgrpo)}"
  common = sorted(set(runs.get(a, {})) & set(runs.get(b, {})))
  fewer = sum(runs[a][s]["zero_advantage_share"] < runs[b][s]["zero_advantage_share"]
              for s in common)
  out["fewer_zero_advantage_pairs"] = f"{fewer} of {len(common)}"
  if not out["manipulation_check"]:
    out["verdict"] = "too hard at this budget: no arm gained 3 points of AUC over step 0"
  elif primary is None or "ci95" not in primary:
    out["verdict"] = "pending: too few paired seeds"
  elif len(common) == 4 and primary["sd"] > study_v3.MAX_SD:
    out["verdict"] = (f"not resolvable at this budget: paired SD {100 * primary['sd']:.1f} "
                      f"points after stage 1, 95% CI {100 * primary['ci95'][0]:+.1f} to "
                      f"{100 * primary['ci95'][1]:+.1f}")
  elif len(common) < 8:
    out["verdict"] = f"pending: {len(common)} of 8 pairs"
  elif (primary["mean"] > 0 and primary["t_p"] < 0.05
        and sum(map(study_v3.healthy, exgrpo)) >= study_v3.MIN_HEALTHY
        and fewer >= SUPPORT_PAIRS):
    out["verdict"] = "support: ExGRPO beats on-policy, by the mechanism's figures too"
  elif primary["ci95"][1] < RESCUE:
    out["verdict"] = (f"no rescue-sized effect: the upper 95% bound "
                      f"{100 * primary['ci95'][1]:+.1f} points is below +9")
  else:
    out["verdict"] = "inconclusive"
  return out


def arm_summary(seeds: dict) -> dict:
  """Per arm, over its seeds: collapses (greedy accuracy at step 40 at least 5 points
  below step 0), and the means of its dynamics at steps 10, 20, 30 and 40 (entropy,
  response length, ratio maxima, grad norm, buffered, retired) and over the run
  (replayed questions a step, zero-advantage share)."""
  runs = list(seeds.values())
  at = lambda name: {str(s): float(np.mean([r["curves"][name][s - 1] for r in runs]))
                     for s in study_v3.EVAL_STEPS}
  return dict(
      seeds=sorted(seeds), auc=float(np.mean([study_v3.auc(r) for r in runs])),
      collapses=sum(r["evals"]["40"]["greedy"] <= r["evals"]["0"]["greedy"] - COLLAPSE
                    for r in runs if "0" in r["evals"]),
      zero_advantage_share=float(np.mean([r["zero_advantage_share"] for r in runs])),
      replayed_per_step=float(np.mean([np.mean(r["curves"]["replayed"]) for r in runs])),
      **{name: at(name) for name in ("entropy", "length", "on_ratio_max", "off_ratio_max",
                                     "grad_norm", "buffered", "retired")})


def report(summaries: str) -> dict:
  runs = load(summaries)
  fallback = bool(runs.get(study_v3.FALLBACK[0]))
  pairs = study_v3.FALLBACK if fallback else study_v3.PRIMARY
  primary = paired(runs, *pairs)
  attribution = [p for arm in study_v3.ATTRIBUTION for other in study_v3.PRIMARY
                 if (p := paired(runs, arm, other, study_v3.STAGE_SEEDS[0]))]
  exploratory = [p for other in study_v3.PRIMARY if (p := paired(runs, "rho50", other))]
  table = [{k: v for k, v in r.items() if k != "curves"} | {"auc": study_v3.auc(r)}
           for seeds in runs.values() for r in seeds.values()]
  return {"protocol": study_v3.__doc__.split("Protocol, fixed before the first run:")[1].strip(),
          "config": study_v3.CONFIG, "runs": table, "primary": primary,
          "attribution": attribution, "exploratory": exploratory,
          "arms": {arm: arm_summary(seeds) for arm, seeds in runs.items()},
          "rules": verdict(runs, primary, pairs), "_runs": runs}


def plot(result: dict, plots: str) -> list[str]:
  runs, paths = result["_runs"], []
  os.makedirs(plots, exist_ok=True)
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, score in zip(axes, ("avg@2", "greedy")):
    for arm, seeds in runs.items():
      for i, run in enumerate(seeds.values()):
        steps = sorted(map(int, run["evals"]))
        ax.plot(steps, [100 * run["evals"][str(s)][score] for s in steps], color=COLORS[arm],
                alpha=0.35, marker=".", label=arm if i == 0 else None)
      steps = sorted({int(s) for r in seeds.values() for s in r["evals"]})
      mean = [np.mean([100 * r["evals"][str(s)][score] for r in seeds.values()
                       if str(s) in r["evals"]]) for s in steps]
      ax.plot(steps, mean, color=COLORS[arm], linewidth=2.5)
    ax.set_title(f"held-out {score} (%), seeds thin, mean thick", fontsize=10)
  paths.append(save_figure(fig, axes, plots, "study_v3_accuracy.png"))
  comparisons = [p for p in [result["primary"], *result["attribution"]] if p]
  fig, ax = plt.subplots(figsize=(7, 4))
  for i, p in enumerate(comparisons):
    ax.scatter([i] * p["n"], 100 * np.array(p["d"]), color="C0")
    ax.errorbar([i + 0.15], [100 * p["mean"]], fmt="o", color="k", capsize=4, yerr=None
                if "ci95" not in p else [[100 * (p["mean"] - p["ci95"][0])],
                                         [100 * (p["ci95"][1] - p["mean"])]])
  ax.axhline(0, color="gray", linewidth=1)
  ax.set_xticks(range(len(comparisons)), [p["pair"] for p in comparisons], fontsize=7,
                rotation=15)
  ax.set_title("paired AUC difference (points): seeds, mean and 95% CI", fontsize=10)
  paths.append(save_figure(fig, [ax], plots, "study_v3_paired.png", per_step=False))
  names = ("entropy", "length", "on_ratio_max", "off_ratio_max", "grad_norm", "buffered",
           "replayed", "fresh_solved", "solve_none")
  fig, axes = plt.subplots(3, 3, figsize=(14, 10))
  for ax, name in zip(axes.flat, names):
    for arm, seeds in runs.items():
      curve = np.mean([r["curves"][name] for r in seeds.values()], axis=0)
      ax.plot(np.arange(1, len(curve) + 1), curve, color=COLORS[arm], label=arm)
    ax.set_title(f"{name}, mean over seeds", fontsize=10)
  paths.append(save_figure(fig, axes.flat, plots, "study_v3_dynamics.png"))
  return paths


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--summaries", default=study_v3.SUMMARIES)
  parser.add_argument("--json", default="docs/results/study_v3.json")
  parser.add_argument("--plots", default="docs/results")
  args = parser.parse_args()
  result = report(args.summaries)
  if not result["_runs"]:
    sys.exit(f"{args.summaries}: no finished runs (<arm>_s<seed>.json)")
  public = {k: v for k, v in result.items() if not k.startswith("_")}
  with open(args.json, "w", encoding="utf-8") as f:
    json.dump(public, f, indent=1)
  print(json.dumps({k: public[k] for k in ("primary", "attribution", "arms", "rules")},
                   indent=1))
  for path in plot(result, args.plots):
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
  main()
