"""Verification throughput of the reward pool on the 500 MATH-500 ground truths.

A developer tool: it writes no published result.

  python scripts/bench/bench_rewards.py [--workers 1,2] [--runs 3]

Two workloads, each response graded against its ground truth with Math-Verify:
  self       "The answer is $\\boxed{<gt>}$"      (should all be correct)
  perturbed  "The answer is $\\boxed{<gt>+1}$"    (should almost all be wrong)
For each worker count: pool start-up time, one cold run (workers' ground-truth parse
cache empty), then the median of `--runs` warm runs. Prints JSON.
"""

import argparse
import json
import os
import statistics
import time

from exgrpo_jax import data
from exgrpo_jax import rewards

# Relative to the data directory, where `python -m exgrpo_jax.prepare_data` writes it.
DEFAULT_DATA = "exgrpo_test_id.parquet"


def workloads(path: str) -> dict[str, list[rewards.RewardItem]]:
  truths = [q.ground_truth for q in data.load_questions(path).questions
            if q.data_source == "math"]
  return {
      "self": [rewards.RewardItem(f"The answer is $\\boxed{{{gt}}}$", gt, "math_verify")
               for gt in truths],
      "perturbed": [rewards.RewardItem(f"The answer is $\\boxed{{{gt}+1}}$", gt,
                                       "math_verify") for gt in truths],
  }


def bench(items, num_workers: int, runs: int, timeout_s: float) -> dict:
  start = time.perf_counter()
  with rewards.RewardPool(num_workers, timeout_s) as pool:
    startup_s = time.perf_counter() - start
    cold_rewards, cold = pool.score(items)
    warm = [pool.score(items) for _ in range(runs)]
  seconds = [stats["seconds"] for _, stats in warm]
  failures = {k: cold[k] for k in ("timeouts", "exceptions", "crashes", "no_answer")}
  return dict(startup_s=round(startup_s, 3),
              cold_items_per_s=round(len(items) / cold["seconds"], 1),
              warm_items_per_s_median=round(len(items) / statistics.median(seconds), 1),
              warm_run_seconds=[round(s, 3) for s in seconds],
              accuracy=float(cold_rewards.mean()), **failures)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", default=DEFAULT_DATA,
                      help="a data file; relative paths are in the data directory "
                      "($EXGRPO_DATA_DIR, else ~/.cache/exgrpo_jax/data)")
  parser.add_argument("--workers", default=f"1,{os.cpu_count()}")
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--timeout", type=float, default=10.0)
  args = parser.parse_args()
  loads = workloads(args.data)
  counts = sorted({int(w) for w in args.workers.split(",")})
  results = {name: {str(w): bench(items, w, args.runs, args.timeout) for w in counts}
             for name, items in loads.items()}
  print(json.dumps(dict(items=len(loads["self"]), cpu_count=os.cpu_count(),
                        note="timing excludes pool start-up; warm = ground-truth parses "
                             "cached in the workers", results=results), indent=2))


if __name__ == "__main__":
  main()
