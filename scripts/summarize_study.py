r"""The small-scale study's table and comparison plot, from the runs' own logs.

  python scripts/summarize_study.py --study runs/study

Reads `<study>/<method>_s<seed>/metrics.jsonl` for every run and `<study>/base_eval.json`
(the untrained model on the same held-out problems). Prints JSON (per run and per
method: final held-out greedy accuracy, mean and sample std over seeds, training
reward, wall time) and a Markdown table, and writes `<study>/comparison.png` (training
reward and held-out accuracy per method, mean over seeds).
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
from exgrpo_jax import checkpointing  # pylint: disable=wrong-import-position
from exgrpo_jax.training import run_log  # pylint: disable=wrong-import-position

METHOD_ORDER = ("onpolicy", "exgrpo", "no_shaping", "no_tsel")


def last_rows(workdir: str) -> list[dict]:
  """One row per step (a resumed run re-logs the steps after its last checkpoint)."""
  return [row for _, row in sorted({r["step"]: r for r in run_log.read_metrics(workdir)}
                                   .items())]


def run_config(workdir: str) -> dict:
  """The training config stored with the run's latest checkpoint."""
  step_dir = checkpointing.latest_step_dir(workdir)
  with open(os.path.join(step_dir, "meta", "metadata"), encoding="utf-8") as f:
    return json.load(f)["config"]


def summarize_run(rows: list[dict], config: dict) -> dict:
  per_step = config["train"]["batch_questions"] * config["rollout"]["k"]
  evals = [r for r in rows if "val/avg_score" in r]
  final = evals[-1] if evals else {}
  return {
      "steps": rows[-1]["step"],
      "final_val_acc": final.get("val/avg_score"),
      "final_val_step": final.get("step"),
      "val_per_source": {k.split("/")[-1]: v for k, v in final.items()
                         if k.startswith("val/test_score/")},
      "train_reward_first3": float(np.mean([r["batch/solved"] for r in rows[:3]])),
      "train_reward_last3": float(np.mean([r["batch/solved"] for r in rows[-3:]])),
      "replayed_questions": int(sum(r.get("experience/batch_size", 0) for r in rows)),
      # The rollout budget: K fresh samples per fresh question, K - 1 per replayed one.
      "fresh_rollouts": int(sum(per_step - r.get("experience/batch_size", 0) for r in rows)),
      "final_entropy": rows[-1].get("actor/entropy"),
      "wall_s": float(sum(r.get("timing_s/step", 0.0) for r in rows)),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--study", default="runs/study")
  args = parser.parse_args()
  runs = collections.defaultdict(dict)
  curves = collections.defaultdict(list)
  for workdir in sorted(glob.glob(os.path.join(args.study, "*_s*"))):
    match = re.fullmatch(r"(.+)_s(\d+)", os.path.basename(workdir))
    if not match or not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
      continue
    rows = last_rows(workdir)
    if not rows or not any("val/avg_score" in r for r in rows[-1:]):
      print(f"{workdir}: unfinished (no final evaluation yet), left out", file=sys.stderr)
      continue
    runs[match[1]][int(match[2])] = summarize_run(rows, run_config(workdir))
    curves[match[1]].append(rows)
  if not runs:
    raise SystemExit(f"{args.study}: no runs with metrics.jsonl")

  result = {"runs": runs, "methods": {}}
  base_path = os.path.join(args.study, "base_eval.json")
  if os.path.exists(base_path):
    with open(base_path) as f:
      result["base_val_acc"] = json.load(f)["overall"]["avg@k"]
  for method in sorted(runs, key=lambda m: (METHOD_ORDER + (m,)).index(m)):
    accs = [r["final_val_acc"] for r in runs[method].values() if r["final_val_acc"] is not None]
    result["methods"][method] = {
        "seeds": sorted(runs[method]),
        "val_acc_mean": float(np.mean(accs)) if accs else None,
        "val_acc_std": float(np.std(accs, ddof=1)) if len(accs) > 1 else None,
        "val_acc_per_seed": accs,
        "train_reward_last3_mean": float(np.mean([r["train_reward_last3"]
                                                  for r in runs[method].values()])),
        "wall_s_mean": float(np.mean([r["wall_s"] for r in runs[method].values()])),
        "fresh_rollouts_mean": float(np.mean([r["fresh_rollouts"]
                                              for r in runs[method].values()])),
    }
  print(json.dumps(result, indent=1))
  print("\n| method | seeds | held-out acc. (%) mean ± std | per seed | "
        "train reward, last 3 steps | fresh rollouts / run | wall time / run |\n"
        "|---|---|---|---|---|---|---|")
  for method, m in result["methods"].items():
    std = f" ± {100 * m['val_acc_std']:.1f}" if m["val_acc_std"] is not None else ""
    mean = f"{100 * m['val_acc_mean']:.1f}" if m["val_acc_mean"] is not None else "n/a"
    per_seed = ", ".join(f"{100 * a:.0f}" for a in m["val_acc_per_seed"])
    print(f"| {method} | {len(m['seeds'])} | {mean}{std} | {per_seed} | "
          f"{m['train_reward_last3_mean']:.3f} | {m['fresh_rollouts_mean']:.0f} | "
          f"{m['wall_s_mean'] / 60:.1f} min |")
  plot_comparison(curves, os.path.join(args.study, "comparison.png"),
                  result.get("base_val_acc"))


def plot_comparison(curves: dict, path: str, base_acc: float | None) -> None:
  fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
  for method, runs in curves.items():
    steps = min(len(rows) for rows in runs)
    reward = np.mean([[r["batch/solved"] for r in rows[:steps]] for rows in runs], axis=0)
    axes[0].plot(np.arange(1, steps + 1), reward, marker="o", label=f"{method} (n={len(runs)})")
    val = collections.defaultdict(list)
    for rows in runs:
      for r in rows:
        if "val/avg_score" in r:
          val[r["step"]].append(r["val/avg_score"])
    if base_acc is not None:
      val[0] = [base_acc]  # the untrained model, the same for every method
    x = sorted(val)
    axes[1].errorbar(x, [np.mean(val[s]) for s in x], yerr=[np.std(val[s]) for s in x],
                     marker="o", capsize=3, label=method)
  axes[0].set_title("training reward, mean over seeds\n(ExGRPO's includes its replayed, "
                    "correct members)", fontsize=10)
  axes[1].set_title("held-out greedy accuracy, mean ± std over seeds\n(step 0: the "
                    "untrained model)", fontsize=10)
  for ax in axes:
    ax.set_xlabel("training step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
  main()
