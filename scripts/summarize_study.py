r"""The small-scale study's tables and plots, from the runs' own logs (docs/results.md).

  python scripts/summarize_study.py --study runs/study --plots docs/results

Reads `<study>/<method>_s<seed>/metrics.jsonl` and `config.json` for every run. The
untrained model's evaluation (step 0) is logged by the on-policy run of each seed and
shared by every method of that seed (same weights, same evaluation key). Writes
`<study>/summary.json` (per run, per method and per paired comparison),
`<study>/tables.md` (the Markdown tables docs/results.md quotes) and the plots under
`--plots`. Needs scipy for the t intervals (the `test` extra has it).

Paired comparisons: for each seed present in both methods, the difference of held-out
accuracy at the same step; mean, a 95% t interval over seeds, and how many seeds favour
the first method.
"""

import argparse
import collections
import glob
import json
import os
import re
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from exgrpo_jax.training import run_log  # pylint: disable=wrong-import-position

METHOD_ORDER = ("onpolicy", "exgrpo", "no_shaping", "no_tsel")
COLORS = dict(zip(METHOD_ORDER, ("C0", "C1", "C2", "C3")))
SCORES = {"greedy": "val/greedy_score", "avg@4": "val/avg_score"}
PAIRS = (("exgrpo", "onpolicy"), ("exgrpo", "no_shaping"), ("exgrpo", "no_tsel"))
CURVES = {  # metric: (title, methods it applies to)
    "batch/fresh_solved": ("training accuracy of the fresh rollouts", None),
    "actor/entropy": ("policy entropy (mean over response tokens)", None),
    "response_length/mean": ("response length (tokens)", None),
    "experience/questions": ("replay buffer: partially solved questions", "replay"),
    "experience/retired": ("retired questions (solved K/K)", "replay"),
    "experience/batch_size": ("replayed questions per step", "replay"),
}


def load_runs(study: str) -> tuple[dict, dict]:
  """{method: {seed: [row per step]}} of the finished runs (a resumed run's re-logged steps
  count once), and the config of one of them (the methods share B, K and the eval)."""
  runs, config = collections.defaultdict(dict), None
  for workdir in sorted(glob.glob(os.path.join(study, "*_s*"))):
    match = re.fullmatch(r"(.+)_s(\d+)", os.path.basename(workdir))
    if not match or not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
      continue
    rows = [row for _, row in sorted({r["step"]: r for r in run_log.read_metrics(workdir)}
                                     .items())]
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
      run_config = json.load(f)
    steps = run_config["train"]["steps"]
    if not rows or rows[-1]["step"] < steps:
      print(f"{workdir}: unfinished ({rows[-1]['step'] if rows else 0}/{steps} steps), "
            "left out", file=sys.stderr)
      continue
    runs[match[1]][int(match[2])] = rows
    config = config or run_config
  if not runs:
    raise SystemExit(f"{study}: no finished runs (<method>_s<seed>/metrics.jsonl)")
  return dict(sorted(runs.items(),
                     key=lambda kv: (METHOD_ORDER + (kv[0],)).index(kv[0]))), config


def evals(runs: dict) -> dict:
  """{method: {seed: {step: {score: value}}}}, step 0 taken from the seed's on-policy run."""
  base = {seed: {name: r[key] for name, key in SCORES.items()}
          for seed, rows in runs.get("onpolicy", {}).items() for r in rows if r["step"] == 0
          and SCORES["greedy"] in r}
  out = {}
  for method, seeds in runs.items():
    out[method] = {}
    for seed, rows in seeds.items():
      points = {r["step"]: {name: r[key] for name, key in SCORES.items()}
                for r in rows if SCORES["greedy"] in r}
      if seed in base:
        points[0] = base[seed]
      out[method][seed] = dict(sorted(points.items()))
  return out


def t_interval(diffs) -> dict:
  from scipy import stats  # pylint: disable=g-import-not-at-top
  d = np.asarray(diffs, float)
  out = {"n": len(d), "mean": float(d.mean()), "ci95": None, "favour": int((d > 0).sum()),
         "against": int((d < 0).sum())}
  if len(d) > 1:
    half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)))
    out["ci95"] = [out["mean"] - half, out["mean"] + half]
  return out


def budget(rows: list[dict], config: dict) -> dict:
  """Rollouts generated: K per fresh question, K - 1 per replayed one (its stored solution
  is reused), and the tokens they hold."""
  per_step = config["train"]["batch_questions"] * config["rollout"]["k"]
  steps = [r for r in rows if r["step"] > 0]
  fresh = [per_step - r.get("experience/batch_size", 0) for r in steps]
  tokens = [f * r["response_length/mean"] for f, r in zip(fresh, steps)]
  return {"rollouts": int(sum(fresh)), "tokens_approx": int(sum(tokens))}


def summarize(study: str) -> dict:
  runs, config = load_runs(study)
  scores = evals(runs)
  methods = {}
  for method, seeds in runs.items():
    steps = sorted({s for per_seed in scores[method].values() for s in per_seed})
    table = {}
    for step in steps:
      for name in SCORES:
        vals = [scores[method][seed][step][name] for seed in seeds
                if step in scores[method][seed]]
        table[f"{name}@{step}"] = {"mean": float(np.mean(vals)), "std": float(
            np.std(vals, ddof=1)) if len(vals) > 1 else None, "per_seed": vals}
    final = [r[-1] for r in seeds.values()]
    spent = [budget(r, config) for r in seeds.values()]
    methods[method] = {
        "seeds": sorted(seeds), "val": table,
        # Fresh rollouts only: a replayed question's stored member is correct by design.
        "solved_step1": float(np.mean([next(x["batch/fresh_solved"] for x in r
                                            if x["step"] == 1) for r in seeds.values()])),
        # The last 3 training steps (a run shorter than 3 steps has a step-0 evaluation
        # row among its last 3 rows).
        "solved_last3": float(np.mean([np.mean([x["batch/fresh_solved"] for x in r
                                                if x["step"] > 0][-3:])
                                       for r in seeds.values()])),
        "final_entropy": float(np.mean([r.get("actor/entropy", np.nan) for r in final])),
        "final_length": float(np.mean([r["response_length/mean"] for r in final])),
        "replayed_questions": float(np.mean([sum(x.get("experience/batch_size", 0)
                                                 for x in r) for r in seeds.values()])),
        "rollouts": float(np.mean([b["rollouts"] for b in spent])),
        "tokens_approx": float(np.mean([b["tokens_approx"] for b in spent])),
        "wall_s": float(np.mean([sum(x.get("timing_s/step", 0.0) for x in r)
                                 for r in seeds.values()])),
    }
  paired = {}
  for a, b in PAIRS:
    if a not in scores or b not in scores:
      continue
    common = sorted(set(scores[a]) & set(scores[b]))
    steps = sorted({s for seed in common for s in scores[a][seed]} - {0})
    paired[f"{a}-{b}"] = {
        f"{name}@{step}": dict(t_interval([scores[a][seed][step][name]
                                           - scores[b][seed][step][name] for seed in common
                                           if step in scores[a][seed]
                                           and step in scores[b][seed]]), seeds=common)
        for step in steps for name in SCORES}
  return {"config": {"model": "SmolLM2-135M-Instruct", "steps": config["train"]["steps"],
                     "batch_questions": config["train"]["batch_questions"],
                     "k": config["rollout"]["k"], "eval_n": config["eval"]["n"],
                     "eval_temperature": config["eval"]["temperature"]},
          "methods": methods, "paired": paired, "_runs": runs, "_scores": scores}


def pct(x) -> str:
  return "n/a" if x is None else f"{100 * x:.1f}"


def tables(result: dict) -> str:
  methods = result["methods"]
  steps = sorted({int(k.split("@")[-1]) for m in methods.values() for k in m["val"]})
  lines = ["| method | seeds | " + " | ".join(f"{n} step {s}" for s in steps for n in SCORES)
           + " |", "|---|---|" + "---|" * (len(steps) * len(SCORES))]
  for method, m in methods.items():
    cells = []
    for s in steps:
      for n in SCORES:
        v = m["val"].get(f"{n}@{s}")
        cells.append("" if v is None else f"{pct(v['mean'])} ± {pct(v['std'])}")
    lines.append(f"| {method} | {len(m['seeds'])} | " + " | ".join(cells) + " |")
  seeds = sorted({seed for m in result["_scores"].values() for seed in m})
  last = steps[-1]
  lines += ["", f"| method, step {last} (greedy / avg@4) | " + " | ".join(
      f"seed {seed}" for seed in seeds) + " |", "|---|" + "---|" * len(seeds)]
  for method, per_seed in result["_scores"].items():
    cells = [f"{pct(per_seed[seed][last]['greedy'])} / {pct(per_seed[seed][last]['avg@4'])}"
             if seed in per_seed and last in per_seed[seed] else "" for seed in seeds]
    lines.append(f"| {method} | " + " | ".join(cells) + " |")
  lines += ["", "| paired difference | seeds | score | mean (points) | 95% t interval | "
            "seeds for / against |", "|---|---|---|---|---|---|"]
  for pair, by_step in result["paired"].items():
    for key, d in by_step.items():
      ci = "n/a" if d["ci95"] is None else f"[{pct(d['ci95'][0])}, {pct(d['ci95'][1])}]"
      lines.append(f"| {pair} | {d['n']} | {key} | {pct(d['mean'])} | {ci} | "
                   f"{d['favour']} / {d['against']} |")
  lines += ["", "| method | fresh-rollout accuracy, step 1 -> last 3 | final entropy | final length | "
            "replayed questions | rollouts generated | response tokens (approx.) | "
            "wall time / run |", "|---|---|---|---|---|---|---|---|"]
  for method, m in methods.items():
    lines.append(f"| {method} | {m['solved_step1']:.3f} -> {m['solved_last3']:.3f} | "
                 f"{m['final_entropy']:.3f} | {m['final_length']:.1f} | "
                 f"{m['replayed_questions']:.1f} | {m['rollouts']:.0f} | "
                 f"{m['tokens_approx']:.0f} | {m['wall_s'] / 60:.1f} min |")
  return "\n".join(lines) + "\n"


def plot(result: dict, out_dir: str) -> list[str]:
  runs, scores, paths = result["_runs"], result["_scores"], []
  os.makedirs(out_dir, exist_ok=True)
  fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
  for ax, name in zip(axes, SCORES):
    for method, per_seed in scores.items():
      steps = sorted({s for v in per_seed.values() for s in v})
      vals = [[v[s][name] for v in per_seed.values() if s in v] for s in steps]
      ax.errorbar(steps, [np.mean(v) for v in vals], yerr=[np.std(v) for v in vals],
                  marker="o", capsize=3, label=f"{method} (n={len(per_seed)})",
                  color=COLORS.get(method))
    ax.set_title(f"held-out {name} accuracy, mean ± std over seeds", fontsize=10)
  paths.append(save_figure(fig, axes, out_dir, "study_accuracy.png"))
  # Training steps only (the on-policy runs also log the step-0 evaluation).
  train = {method: [[r for r in rows if r["step"] > 0] for rows in per_seed.values()]
           for method, per_seed in runs.items()}
  fig, axes = plt.subplots(2, 3, figsize=(14, 7))
  for ax, (metric, (title, scope)) in zip(axes.flat, CURVES.items()):
    for method, per_seed in train.items():
      if scope == "replay" and method == "onpolicy":
        continue
      n = min(len(rows) for rows in per_seed)
      curve = np.array([[r.get(metric, 0.0) for r in rows[:n]] for rows in per_seed])
      ax.plot(np.arange(1, n + 1), curve.mean(0), marker=".", label=method,
              color=COLORS.get(method))
    ax.set_title(title + ", mean over seeds", fontsize=10)
  paths.append(save_figure(fig, axes.flat, out_dir, "study_dynamics.png"))
  if "exgrpo" in train:
    fig, ax = plt.subplots(figsize=(6, 3.8))
    per_seed = train["exgrpo"]
    n = min(len(rows) for rows in per_seed)
    bottom = np.zeros(n)
    for b in (1, 2, 3):
      counts = np.mean([[r.get(f"bucket/{b}_count", 0) for r in rows[:n]]
                        for rows in per_seed], 0)
      ax.bar(np.arange(1, n + 1), counts, bottom=bottom, label=f"{b}/4 correct")
      bottom += counts
    ax.set_title("ExGRPO buffer by bucket (correct rollouts of K = 4), mean over seeds",
                 fontsize=9)
    paths.append(save_figure(fig, [ax], out_dir, "study_buckets.png"))
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


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--study", default="runs/study")
  parser.add_argument("--plots", default=None, help="plot directory (default: the study's)")
  args = parser.parse_args()
  result = summarize(args.study)
  public = {k: v for k, v in result.items() if not k.startswith("_")}
  with open(os.path.join(args.study, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(public, f, indent=1)
  text = tables(result)
  with open(os.path.join(args.study, "tables.md"), "w", encoding="utf-8") as f:
    f.write(text)
  print(json.dumps(public, indent=1))
  print(text)
  for path in plot(result, args.plots or args.study):
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
  main()
