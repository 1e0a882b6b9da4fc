r"""Which pool-size ladder for XLA's attention: decode programs compiled against the pool
read in vain, from the plans' compiled programs (JSON).

Shown in docs/sampler_performance.md ("Choosing the pool's sizes").

  python scripts/bench/pool_ladder.py [--plans 'docs/results/aot_*_h*x8.json'] \
      [--out docs/results/pool_ladder.json]

XLA's paged attention (GPUs, CPUs) reads the whole page pool every decode step, so a
rollout's tail, a few long rows in a pool sized for many, reads mostly empty pages; each
pool size is one more `decode_chunk` program to compile. For each plan and each length
scenario (`aot.lengths.SCENARIOS`, and every row at the cap), the continuous scheduler
runs without a model (`schedule.simulate`) and its chunks are priced by the plan's
compiled programs (`lengths.rollout_estimate`), once per ladder: the one before this
script (8 linear sizes, the smallest 1/8 of the largest), 16, 32 and 64 linear sizes,
a geometric one of ratio sqrt(2) down to one row per shard, and the engine's
(`pages.ladder`: 32 linear sizes, then halves of the smallest down to one row a shard). The
JSON has, per plan, scenario and ladder, the rollout's roofline seconds and the sizes it
used, with the plan's own `decode_chunk` compile seconds (on this host, for that target)
as the price of each size.
"""

import argparse
import glob
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from exgrpo_jax.aot import lengths  # pylint: disable=wrong-import-position
from exgrpo_jax.sampling import decode  # pylint: disable=wrong-import-position
from exgrpo_jax.sampling import pages  # pylint: disable=wrong-import-position



def linear(full: int, per_row: int, shards: int, sizes: int) -> list[int]:
  """`sizes` sizes k/sizes of `full`, in steps of at least a row's pages (the rule
  before the geometric ladder)."""
  unit = -(-max(-(-full // sizes), per_row) // shards) * shards
  return [min(unit * k, full) for k in range(1, -(-full // unit) + 1)]


def geometric(full: int, floor: int, shards: int, ratio: float = math.sqrt(2)) -> list[int]:
  """`full`, full / ratio, full / ratio^2, ... down to `floor`, multiples of `shards`."""
  sizes, size = {full}, full
  while size > floor:
    size = max(size / ratio, floor)
    sizes.add(min(-(-math.ceil(size) // shards) * shards, full))
  return sorted(sizes)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--plans", default="docs/results/aot_*_h*x8.json")
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  results = []
  for path in sorted(glob.glob(args.plans)):
    with open(path, encoding="utf-8") as f:
      plan = json.load(f)
    report = plan.get("report")
    if not report or not report.get("step_estimate"):
      continue
    price = lengths.prices(report)
    if price.kernel:
      continue  # the kernel reads live pages only: one pool size
    b = report["batch"]
    L, N = decode.length_bucket(b["prompt_tokens"], 16), b["response_tokens"]
    today = pages.PageTable(b["max_rows"], pages.PAGE, L, N, price.shards)
    full, per_row = today.sizes[-1], today.table_BxN.shape[1]
    ladders = {f"linear {n}" + (" (before)" if n == 8 else ""):
               linear(full, per_row, price.shards, n) for n in (8, 16, 32, 64)}
    ladders["geometric sqrt2"] = geometric(full, per_row * price.shards, price.shards)
    ladders[f"linear {pages.POOL_STEPS}, then halves (chosen)"] = pages.ladder(
        full, per_row, price.shards)
    compile_s = next(q["compile_s"] for q in report["programs"] if q["name"] == "decode_chunk")
    rows = b["questions"] * b["k"]
    entry = dict(plan=os.path.basename(path), slots=b["max_rows"], rows=rows,
                 decode_chunk_compile_s=round(compile_s, 1),
                 ladder_sizes={k: len(v) for k, v in ladders.items()}, scenarios={})
    for scenario in [*lengths.SCENARIOS, "at_cap"]:
      lengths_R = (lengths.at_cap(N, rows) if scenario == "at_cap"
                   else lengths.scenario(scenario, N, rows))
      entry["scenarios"][scenario] = {}
      for name, sizes in ladders.items():
        est = lengths.rollout_estimate(report, lengths_R, sizes=sizes)
        entry["scenarios"][scenario][name] = dict(
            rollout_s=round(est["rollout_s"], 1), sizes_used=est["pool_sizes"],
            compile_s=round(est["pool_sizes"] * compile_s, 1))
      print(f"[ladder] {entry['plan']} {scenario}: " + ", ".join(
          f"{k} {v['rollout_s']} s/{v['sizes_used']}" for k, v in
          entry["scenarios"][scenario].items()), file=sys.stderr, flush=True)
    results.append(entry)
  out = json.dumps(dict(
      method="roofline seconds of the simulated continuous scheduler (aot.lengths), "
             "from each plan's compiled programs; compile_s: sizes used x the plan's "
             "decode_chunk compile seconds on the planning host",
      scenarios={k: dict(mean_tokens_at_8192=v[0], at_cap_share=v[1])
                 for k, v in lengths.SCENARIOS.items()},
      plans=results), indent=1)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(out + "\n")
  print(out)


if __name__ == "__main__":
  main()
