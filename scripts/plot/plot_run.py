r"""Learning curves of a training run as PNGs (the paper's Figure 5 panels and more).

A tool for your own runs (README.md lists it): it writes no published result; the
study's figures in docs/results.md come from `python -m exgrpo_jax.study`.

  python scripts/plot/plot_run.py --workdir runs/smollm2 [--out runs/smollm2/plots]

Reads `<workdir>/metrics.jsonl`; writes reward_and_validation.png, entropy.png,
response_length.png, buffer.png (buffered questions and retired set over steps) and
buckets.png (bucket histogram over time).
"""

import argparse
import os
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from exgrpo_jax.training import run_log  # pylint: disable=wrong-import-position


def series(rows, key):
  points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
  return (np.array([p[0] for p in points]), np.array([p[1] for p in points]))


def line_plot(rows, keys, title, path, ylabel=""):
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for key in keys:
    x, y = series(rows, key)
    if len(x):
      ax.plot(x, y, marker="o" if len(x) < 30 else None, label=key)
  ax.set_title(title)
  ax.set_xlabel("training step")
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def bucket_plot(rows, path):
  keys = sorted({k for r in rows for k in r if k.startswith("bucket/")},
                key=lambda k: int(k.split("/")[1].split("_")[0]))
  if not keys:
    return
  steps = np.array([r["step"] for r in rows])
  counts = np.array([[r.get(k, 0) for k in keys] for r in rows], float)
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.stackplot(steps, counts.T, labels=[k.split("/")[1].split("_")[0] + " correct"
                                        for k in keys])
  ax.set_title("buffered questions per bucket (correct rollouts out of K)")
  ax.set_xlabel("training step")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--out", default=None, help="default: <workdir>/plots")
  args = parser.parse_args(argv)
  path = os.path.join(args.workdir, "metrics.jsonl")
  if not os.path.exists(path):
    print(f"error: {path} does not exist (not a training workdir?)", file=sys.stderr)
    return 1
  rows = run_log.read_metrics(args.workdir)
  out = args.out or os.path.join(args.workdir, "plots")
  os.makedirs(out, exist_ok=True)
  val_keys = sorted({k for r in rows for k in r if k.startswith("val/test_score/")})
  line_plot(rows, ["batch/solved", "batch/fresh_solved", "val/avg_score"] + val_keys,
            "reward and validation", os.path.join(out, "reward_and_validation.png"),
            "accuracy")
  line_plot(rows, ["actor/entropy"], "policy entropy", os.path.join(out, "entropy.png"))
  line_plot(rows, ["response_length/mean", "response_length/max"], "response length",
            os.path.join(out, "response_length.png"), "tokens")
  line_plot(rows, ["experience/questions", "experience/retired"],
            "replay buffer and retired set", os.path.join(out, "buffer.png"), "questions")
  bucket_plot(rows, os.path.join(out, "buckets.png"))
  print(f"wrote plots for {len(rows)} steps to {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
