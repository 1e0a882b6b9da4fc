"""Rollout seconds at real response lengths, from a plan's compiled programs.

  lengths = scenario("mid", cap=8192, rows=1024)          # or recorded(path, ...), at_cap
  est = rollout_estimate(report, lengths)                  # today's slots and pool
  est = rollout_estimate(report, lengths, slots=1024, capacity=pages, headroom=0.1)

`check.step_estimate` prices every row at `max_new_tokens`, the worst case. Real rollouts
end far earlier (SCENARIOS), so here the continuous scheduler runs over a length
distribution without a model (`schedule.simulate`: the engine's own decisions, chunk by
chunk), and each chunk is priced by the same roofline (`analysis.bound_s`) from the
report's compiled `decode_chunk`: its bytes per call less the pool it was compiled with,
plus the pool of that chunk's size (read whole each step by XLA's attention, only the
live rows' pages by the TPU kernel; updated in place, so not moved whole per call,
`analysis.call_bytes`, except in reports from before that rule); its FLOPs in
proportion to the chunk's slots and steps. Placing rows (`place`) is priced likewise, a
preempted row's resume by the prefill's cost per token (`admit`), a pool resize by
`repage_layer` per layer. What does not depend on the lengths (the parameters' copy,
`empty`, `admit`'s prompts) is taken as compiled. Estimates, not measurements: the
simulation's slots and pool beyond what was compiled assume the decode program still
fits (the planner checks that by compiling).
"""

import dataclasses
import json
import math
import re

import numpy as np

from exgrpo_jax.aot import analysis
from exgrpo_jax.sampling import decode
from exgrpo_jax.sampling import pages
from exgrpo_jax.sampling import schedule

# Response lengths at an 8,192-token cap from public RL runs (mean tokens, share at the
# cap): a verl run's mean at its cap scaled up, DeepScaleR's late and early training.
SCENARIOS = {"short": (1278, 0.02), "mid": (3501, 0.09), "long": (5737, 0.39)}
SCENARIO_CAP = 8192
PAGE = pages.PAGE  # the engine's page size (tokens)


def scenario(name: str, cap: int, rows: int, seed: int = 0) -> np.ndarray:
  """`rows` lengths with SCENARIOS[name]'s mean and share at the cap, scaled to `cap`."""
  mean, share = SCENARIOS[name]
  return from_mean(mean * cap / SCENARIO_CAP, share, cap, rows, seed)


def from_mean(mean: float, cap_share: float, cap: int, rows: int, seed: int = 0):
  """`rows` lengths: `cap_share` of them at `cap`, the rest from a Beta(2, b) on (0, cap)
  whose b makes the mean `mean` (a fixed seed: the same lengths every time)."""
  at_cap = round(cap_share * rows)
  below = (mean * rows - at_cap * cap) / max(rows - at_cap, 1) / cap
  if not 0 < below < 1:
    raise ValueError(f"a mean of {mean:g} tokens with {cap_share:.0%} at the cap of {cap} "
                     "leaves no lengths below the cap")
  draws = np.random.default_rng(seed).beta(2.0, 2.0 * (1 - below) / below, rows - at_cap)
  draws *= below / draws.mean()  # the mean exactly, not just in expectation
  lengths = np.clip(np.round(draws * cap), 1, cap - 1).astype(np.int64)
  return np.random.default_rng(seed).permutation(np.r_[lengths, np.full(at_cap, cap)])


def recorded(path: str, cap: int, rows: int) -> np.ndarray:
  """Lengths from `scripts/bench/record_rollout_lengths.py`'s JSON, each as its share of that
  record's cap, scaled to `cap` and resampled (in order, cycled) to `rows`."""
  with open(path, encoding="utf-8") as f:
    try:
      record = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{path}: not a JSON file ({e})") from None
  try:
    lens, max_new = record["response_lens"], record["max_new_tokens"]
  except (KeyError, TypeError) as e:
    raise ValueError(f"{path}: not a record of rollout lengths (no {e})") from None
  if not _whole(max_new) or max_new < 1:
    raise ValueError(f"{path}: max_new_tokens={max_new!r}: must be a whole number of "
                     "tokens above 0 (the cap the lengths were recorded at)")
  if not isinstance(lens, list) or not lens:
    raise ValueError(f"{path}: response_lens={lens!r}: must be a non-empty list of lengths")
  for i, n in enumerate(lens):
    if not _whole(n) or not 0 <= n <= max_new:
      raise ValueError(f"{path}: response_lens[{i}]={n!r}: must be a whole number of "
                       f"tokens in [0, max_new_tokens={max_new}]")
  share = np.asarray(lens, float) / max_new
  return np.clip(np.round(np.resize(share, rows) * cap), 1, cap).astype(np.int64)


def _whole(n) -> bool:
  return isinstance(n, int) and not isinstance(n, bool)


def at_cap(cap: int, rows: int) -> np.ndarray:
  return np.full(rows, cap)


@dataclasses.dataclass
class Prices:
  """What one chunk of a plan's decode and its neighbours cost (see the docstring)."""
  kernel: bool           # the TPU paged-attention kernel (reads live pages only)
  shards: int            # the pool's split over the batch axes
  page_bytes: float      # one page's KV, all layers, per device
  decode_fixed: float    # decode_chunk's bytes once per call without its pool
  pool_moves: int        # times a call moves the whole pool: 0 in place, else 2
  step_bytes: float      # a decode step's bytes without the pool it reads
  step_flops: float      # a decode step's FLOPs per device per slot
  place_fixed: float     # place's bytes once per call without the pool
  prefill_token_s: float  # admit's roofline per prompt token
  repage_s: float        # one layer's resize (roofline), times layers per resize
  fixed_s: float         # the programs run once a rollout
  admit_s: float         # admit's calls as compiled (prompts do not change)
  target: dict           # the report's target (analysis.bound_s)
  layers: int


def kv_layout(report: dict) -> tuple[int, float]:
  """The pool's split over the batch axes and one page's KV bytes per device over all
  layers: KV heads split by tensor where they divide, in the model's compute dtype (the
  engine's pool dtype)."""
  m, tensor = report["model"], report["mesh"].get("tensor", 1)
  kv_heads = m["kv_heads"] // tensor if m["kv_heads"] % tensor == 0 else m["kv_heads"]
  dtype_bytes = 2 if m["dtype"] in ("bfloat16", "float16") else 4
  return (report["devices"] // tensor,
          PAGE * 2 * kv_heads * (m["hidden"] // m["heads"]) * dtype_bytes * m["layers"])


def row_pages(report: dict) -> int:
  """The pages of one row at its longest in a plan report's batch (`pages.pages_per_row`)."""
  b = report["batch"]
  return pages.pages_per_row(b["prompt_tokens"], b["response_tokens"])


def capacity_pages(plan_: dict) -> int:
  """A plan's KV pool in pages: its `rollout.kv_pages`, else every slot's row at its
  longest, in whole pages per batch shard."""
  chosen, report = plan_["chosen"], plan_["report"]
  if chosen.get("kv_pages"):
    return chosen["kv_pages"]
  shards, _ = kv_layout(report)
  return row_pages(report) * chosen["max_rows"] // shards * shards


def prices(report: dict) -> Prices:
  """A plan report's programs as `Prices` (its `report` key, `check.report`'s JSON)."""
  m, b = report["model"], report["batch"]
  target = report["target"]
  programs = {p["name"]: p for p in report["programs"]}
  decode_p, place, admit = programs["decode_chunk"], programs["place"], programs["admit"]
  shards, page_bytes = kv_layout(report)
  steps, slots, pool = map(int, re.match(r"(\d+) decode steps of (\d+) slots over the "
                                         r"(\d+)-page", decode_p["purpose"]).groups())
  pool_bytes = pool / shards * page_bytes
  kernel = "tpu_custom_call" in decode_p["custom_calls"]
  L = decode.length_bucket(b["prompt_tokens"], 16)
  N = b["response_tokens"]
  per_row = row_pages(report)
  share = (L + N / 2) / (per_row * PAGE) if kernel else 1.0  # as `programs` compiled it
  streamed = (decode_p["hbm_bytes_per_call"] - analysis.call_bytes(decode_p)) / steps
  pool_moves = 0 if decode_p.get("in_place") else 2
  prompts_per_admit = int(re.match(r"prefill of (\d+) prompts x (\d+)", admit["purpose"])[1])
  return Prices(
      kernel=kernel, shards=shards, page_bytes=page_bytes,
      decode_fixed=analysis.call_bytes(decode_p) - pool_moves * pool_bytes,
      pool_moves=pool_moves,
      step_bytes=streamed - share * pool_bytes,
      step_flops=decode_p["flops_per_device"] / steps / slots,
      place_fixed=analysis.call_bytes(place) - pool_moves * pool_bytes,
      prefill_token_s=admit["roofline_s"] / (prompts_per_admit * L),
      repage_s=programs["repage_layer"]["roofline_s"] * m["layers"]
      if "repage_layer" in programs else 0.0,  # a pool of one size
      fixed_s=sum(programs[n]["roofline_s"] * programs[n]["calls_per_step"]
                  for n in ("rollout_copy", "prepare_layers", "empty")),
      admit_s=admit["roofline_s"] * admit["calls_per_step"],
      target=target, layers=m["layers"])


def rollout_estimate(report: dict, lengths_R, slots: int | None = None,
                     capacity: int | None = None, headroom: float = 0.0,
                     sizes: list[int] | None = None) -> dict:
  """The rollout's roofline seconds for rows of `lengths_R` (see the module docstring):
  in `slots` slots (default: the plan's) with a pool of `capacity` pages (default: the
  plan's `rollout.kv_pages`, else every slot's row at its longest) and `headroom`, the
  pool's sizes the engine's (`pages.ladder`) or `sizes` (a ladder to compare)."""
  b = report["batch"]
  price = prices(report)
  L, N = decode.length_bucket(b["prompt_tokens"], 16), b["response_tokens"]
  if slots is None:
    slots, capacity = b["max_rows"], capacity or b.get("kv_pages") or None
  table = pages.PageTable(slots, PAGE, L, N, price.shards, capacity,
                          kernel=price.kernel)
  if sizes is not None:
    table.sizes, table.owner_P = sizes, np.full(sizes[0], -1)
  trace = schedule.simulate(lengths_R, np.full(len(lengths_R), b["prompt_tokens"]), table, N,
                            16, table.keep_free(headroom))
  pool_C = trace.pool_pages_C / price.shards * price.page_bytes
  read_C = (trace.held_pages_C if price.kernel else trace.pool_pages_C) / price.shards
  bytes_C = (price.decode_fixed + price.pool_moves * pool_C
             + trace.steps_C * (price.step_bytes + read_C * price.page_bytes))
  flops_C = price.step_flops * trace.steps_C * trace.slots_C
  decode_s = analysis.bound_s(flops_C, bytes_C, price.target).sum()
  place_C = np.ceil(trace.admitted_C / 16) * (price.place_fixed + price.pool_moves * pool_C)
  place_s = place_C.sum() / price.target["hbm_bandwidth"]
  resume_s = price.prefill_token_s * (trace.recomputed_tokens + L * trace.resumed)
  repage_s = price.repage_s * np.count_nonzero(np.diff(trace.pool_pages_C))
  rollout_s = decode_s + place_s + resume_s + repage_s + price.admit_s + price.fixed_s
  return dict(rollout_s=float(rollout_s), decode_s=float(decode_s),
              place_s=float(place_s), resume_s=float(resume_s), repage_s=float(repage_s),
              slots=slots, capacity_pages=table.sizes[-1],
              pool_sizes=len(trace.pool_sizes), preemptions=trace.preemptions,
              recomputed_tokens=trace.recomputed_tokens,
              mean_length=float(np.mean(lengths_R)),
              at_cap_share=float(np.mean(np.asarray(lengths_R) >= N)))


def distributions(cap: int, rows: int, path: str | None = None,
                  mean: float | None = None, cap_share: float = 0.0) -> dict:
  """The length distributions to estimate at: the one given (a record, or a mean and a
  share at the cap), else the three SCENARIOS; and every row at the cap."""
  if path:
    given = {f"recorded ({path.rsplit('/', 1)[-1]})": recorded(path, cap, rows)}
  elif mean is not None:
    given = {f"mean {mean:g}, {cap_share:.0%} at cap": from_mean(mean, cap_share, cap, rows)}
  else:
    given = {name: scenario(name, cap, rows) for name in SCENARIOS}
  return given | {"at cap": at_cap(cap, rows)}


def best_slots(report: dict, lengths_R, headroom: float, today: dict | None = None,
               choices: int = 4, capacity: int | None = None, also=()) -> dict:
  """`rollout_estimate` with admission at the slot count that costs least: today's (its
  pool, nothing preempted; `today`, where already estimated) or `choices` more, evenly
  spaced up to every row in a slot (multiples of 64), each over a pool of `capacity`
  pages (default: today's) with `headroom` kept free, and no dearer than today's (its
  slots over its pool) at any length distribution of `also` either. Ties go to fewer
  slots. Only the plan's own slots are compiled: the others' estimates assume they
  fit."""
  today = today or rollout_estimate(report, lengths_R)
  rows, slots = len(lengths_R), today["slots"]
  more = {min(rows, -(-(slots + (rows - slots) * k // choices) // 64) * 64)
          for k in range(1, choices + 1)}
  capacity = capacity or today["capacity_pages"]
  also = [(d, rollout_estimate(report, d, slots=slots, capacity=today["capacity_pages"])
           ["rollout_s"]) for d in also]
  estimates = [today] + [
      e for n in sorted(more) if n > slots
      if (e := rollout_estimate(report, lengths_R, slots=n, capacity=capacity,
                                headroom=headroom))
      and all(rollout_estimate(report, d, slots=n, capacity=capacity,
                               headroom=headroom)["rollout_s"] <= s for d, s in also)]
  return min(estimates, key=lambda e: (round(e["rollout_s"], 6), e["slots"]))


def today_estimate(plan: dict, lengths_R) -> dict:
  """`rollout_estimate` in today's slots, each row's pool at its longest: a plan made
  with admission had them as its reserved rows (`chosen.reserved_rows`)."""
  reserved = plan.get("chosen", {}).get("reserved_rows")
  return rollout_estimate(plan["report"], lengths_R, slots=reserved)


def admitting_estimate(plan: dict, lengths_R, headroom: float) -> dict:
  """`rollout_estimate` of the plan as compiled: its slots over its pool
  (`rollout.kv_pages`, else every slot's row at its longest), admitting rows as pages
  free with `headroom` kept (`best_slots` is what other slot counts would do)."""
  return rollout_estimate(plan["report"], lengths_R, headroom=headroom)


def table(plans: list[tuple[str, dict]], headroom: float = 0.1, **given) -> str:
  """Markdown: per plan, the rollout's roofline seconds as compiled (every row at the
  cap, `check.step_estimate`) and simulated at each distribution (`distributions`), in
  today's slots (a pool of every slot's row at its longest) and with admission as
  compiled (`admitting_estimate`: seconds, preemptions in brackets, slots after the @)."""
  lines = []
  for name, plan in plans:
    b = plan["report"]["batch"]
    rows, cap = b["questions"] * b["k"], b["response_tokens"]
    dists = distributions(cap, rows, **given)
    if not lines:
      lines = [" | ".join(["| config | target | rows per call | compiled s (all at cap)",
                           *(f"{d} s" for d in dists),
                           *(f"admitting, {d} s" for d in dists)]) + " |",
               "|" + "---|" * (4 + 2 * len(dists))]
    today = [today_estimate(plan, d) for d in dists.values()]
    admitting = [admitting_estimate(plan, d, headroom) for d in dists.values()]
    lines.append(" | ".join([
        f"| {name} | {plan['target']} | {b['max_rows']}",
        f"{plan['report']['step_estimate']['rollout_s']:.0f}",
        *(f"{e['rollout_s']:.0f}" for e in today),
        *(f"{e['rollout_s']:.0f} ({e['preemptions']}) @{e['slots']}" for e in admitting)])
        + " |")
  return "\n".join(lines)
