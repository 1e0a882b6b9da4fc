r"""One KV budget, two ways to spend it: slots sized for rows at their longest, or
admission by free pages with preemption (`rollout.kv_pages`), side by side (JSON).

Shown in docs/sampler_performance.md ("A pool smaller than every row at its longest").

  python scripts/bench/bench_admission.py [--rows 256] [--new-tokens 512] [--budget-rows 64]
      [--slots 256] [--repeats 2] [--model PATH]

Both engines hold at most the KV pages of `--budget-rows` rows at their longest (prompt
bucket + `--new-tokens`, pages of 64). Today's engine decodes in `--budget-rows` slots,
each reserving a full-length row; the admission engine decodes in `--slots` slots and
admits rows while pages are free (`rollout.kv_headroom`, `--headroom`), preempting the
newest when they run out. Greedy rollouts of `--rows` chat prompts (one row each) that
end on EOS, so their lengths are the model's own. Calls alternate between the engines,
each once unmeasured first (compiles); the JSON gives each call's new tokens per second
(compile time excluded), preemptions and recomputed tokens, the median ratio
admission / today, and how many rows came out identical. `simulated` replays the rows'
own lengths through the engine's scheduler (`schedule.simulate`, no model) at other slot
counts over the same budget (`--sweep`): the slot-steps each would decode and the live
rows per step. `cost_model` fits every measured decode chunk's seconds to its slot-steps,
steps and pool pages read, and from that fit bounds what any slot count could reach.
"""

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from exgrpo_jax import cli  # pylint: disable=wrong-import-position
from exgrpo_jax import models  # pylint: disable=wrong-import-position
from exgrpo_jax import sampling  # pylint: disable=wrong-import-position
from exgrpo_jax.sampling import decode  # pylint: disable=wrong-import-position
from exgrpo_jax.sampling import pages  # pylint: disable=wrong-import-position
from exgrpo_jax.sampling import schedule  # pylint: disable=wrong-import-position
from exgrpo_jax.sampling import slots as slots_lib  # pylint: disable=wrong-import-position
from scripts.bench import bench_sampler  # pylint: disable=wrong-import-position

PAGE = pages.PAGE  # the engine's page size
COUNTED = ("compile_s", "new_tokens", "decode_steps", "slot_steps", "preemptions",
           "recomputed_tokens")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="", help="HF dir or .gguf (default: embedded SmolLM2)")
  p.add_argument("--rows", type=cli.positive_int, default=256)
  p.add_argument("--new-tokens", type=cli.positive_int, default=512)
  p.add_argument("--budget-rows", type=cli.positive_int, default=64,
                 help="the KV budget, in rows at their longest")
  p.add_argument("--slots", type=cli.positive_int, default=256,
                 help="the admission engine's slots")
  p.add_argument("--headroom", type=headroom, default=pages.KV_HEADROOM,
                 help="the share of the pool kept free when admitting (rollout.kv_headroom)")
  p.add_argument("--repeats", type=cli.positive_int, default=2,
                 help="measured calls per engine (after one that compiles)")
  p.add_argument("--sweep", default="64,128,192,256", type=slot_counts,
                 help="slot counts `simulated` replays the rows' lengths at")
  args = p.parse_args(argv)
  policy = models.from_pretrained(args.model or None)
  tokenizer = models.load_tokenizer(args.model or None)
  prompts = bench_sampler.chat_prompts(tokenizer, args.rows)
  prompt_len = decode.length_bucket(max(map(len, prompts)), 16)
  per_row = pages.pages_per_row(max(map(len, prompts)), args.new_tokens)
  engines = {
      "today": sampling.make_engine("jax", policy.config, tokenizer, max_rows=args.budget_rows,
                                    continuous_from=0, page_size=PAGE),
      "admission": sampling.make_engine("jax", policy.config, tokenizer, max_rows=args.slots,
                                        page_size=PAGE, kv_pages=args.budget_rows * per_row,
                                        kv_headroom=args.headroom)}
  config = sampling.SamplingConfig(greedy=True, max_new_tokens=args.new_tokens)
  chunk_s = {name: _time_chunks(engine) for name, engine in engines.items()}
  calls, outs = {name: [] for name in engines}, {}
  for i in range(args.repeats + 1):  # call 0 compiles
    for name, engine in engines.items():
      before, load = {k: engine.stats[k] for k in COUNTED}, os.getloadavg()[0]
      chunk_s[name].clear()
      start = time.perf_counter()
      outs[name] = engine.generate(prompts, 1, policy.params, jax.random.key(0), config)
      delta = {k: engine.stats[k] - before[k] for k in COUNTED}
      seconds = time.perf_counter() - start - delta["compile_s"]
      call = dict(delta, seconds=seconds, tokens_per_s=delta["new_tokens"] / seconds,
                  load_before=load, load_after=os.getloadavg()[0], measured=i > 0)
      bench_sampler.log(f"{name} call {i}: {json.dumps(call)}")
      calls[name].append(dict(call, chunk_s=[round(t, 5) for t in chunk_s[name]]))
  same_N = (outs["today"].tokens_NxT == outs["admission"].tokens_NxT).all(1)
  measured = {name: [c for c in c_list if c["measured"]] for name, c_list in calls.items()}
  lengths_R, prompt_len_R = outs["today"].lengths_N, [len(q) for q in prompts]
  runs = traces(lengths_R, prompt_len_R, prompt_len, args.budget_rows * per_row,
                engines["today"].chunk_steps, args,
                {"today": args.budget_rows, "admission": args.slots,
                 **{f"admission_{b}": b for b in args.sweep}})
  result = dict(
      model=args.model or "SmolLM2-135M-Instruct (embedded)",
      device=str(jax.devices()[0].device_kind), cpu_count=os.cpu_count(), rows=args.rows,
      new_tokens=args.new_tokens, prompt_bucket=prompt_len, pages_per_row=per_row,
      kv_budget_pages=args.budget_rows * per_row, slots=dict(today=args.budget_rows,
                                                              admission=args.slots),
      headroom=args.headroom, timing="new tokens / s per call, compile excluded",
      mean_length=float(lengths_R.mean()),
      eos_fraction=float(1 - outs["today"].truncated_N.mean()),
      rows_identical=int(same_N.sum()),
      max_logprob_diff=float(np.abs(outs["today"].logprobs_NxT
                                    - outs["admission"].logprobs_NxT).max()),
      calls=calls,
      simulated={name: summary(trace, slots) for name, (trace, slots) in runs.items()
                 if name.startswith("admission_") or name == "today"},
      tokens_per_s={name: statistics.median(c["tokens_per_s"] for c in m)
                    for name, m in measured.items()},
      speedup=statistics.median(a["tokens_per_s"] / t["tokens_per_s"] for t, a in
                                zip(measured["today"], measured["admission"])),
      cost_model=cost_model(measured, runs, lengths_R))
  print(json.dumps(result, indent=1))


def slot_counts(text: str) -> list[int]:
  """--sweep's comma-separated slot counts (argparse names the flag when one is not)."""
  return [cli.positive_int(b) for b in text.split(",")]


def headroom(text: str) -> float:
  """An argparse type: `rollout.kv_headroom`'s range, a share in [0, 1)."""
  value = float(text)
  if not 0 <= value < 1:
    raise argparse.ArgumentTypeError(f"must be a share in [0, 1), got {value:g}")
  return value


def _time_chunks(engine) -> list:
  """Makes `engine` time each decode chunk it runs (the engine reads every chunk's output
  before the next, so waiting for it changes nothing); returns the list it appends to."""
  seconds, compiled = [], engine.compiled

  def timed_compiled(program, args, static, takes_cfg=True):
    run = compiled(program, args, static, takes_cfg)
    if program is not slots_lib.decode_chunk:
      return run

    def timed(*call_args):
      start = time.perf_counter()
      out = jax.block_until_ready(run(*call_args))
      seconds.append(time.perf_counter() - start)
      return out
    return timed
  engine.compiled = timed_compiled
  return seconds


def traces(lengths_R, prompt_len_R, prompt_len, budget, chunk_steps, args, runs) -> dict:
  """{name: (the chunks the engine's scheduler runs for rows of these lengths, no model;
  its slots)}: `budget_rows` slots reserving full rows ("today"), else admission in that
  many slots over the same `budget` (pages)."""
  result = {}
  for name, slots in runs.items():
    capacity = None if name == "today" else budget
    table = pages.PageTable(slots, PAGE, prompt_len, args.new_tokens, 1, capacity)
    result[name] = (schedule.simulate(lengths_R, np.asarray(prompt_len_R), table,
                                      args.new_tokens, chunk_steps,
                                      table.keep_free(args.headroom)), slots)
  return result


def summary(trace, slots) -> dict:
  """A simulated rollout's totals: its steps, slot-steps, row-steps and live rows a step."""
  row_steps = int((trace.steps_C * trace.rows_C).sum())
  return dict(slots=slots, decode_steps=int(trace.steps_C.sum()),
              slot_steps=int((trace.steps_C * trace.slots_C).sum()), row_steps=row_steps,
              mean_live_rows=row_steps / int(trace.steps_C.sum()),
              preemptions=trace.preemptions)


def cost_model(measured, runs, lengths_R) -> dict:
  """A decode chunk's seconds fitted (least squares over every measured chunk of both
  engines) as ms per slot-step (the matmuls), per decode step (what a step pays at any
  batch: reading the weights), per pool page a step reads (XLA's attention reads the whole
  pool) and per chunk; and from it the least time any slot count could take over this
  budget: a step per row token, no idle slot, the fewest steps (the longest row's), the
  pool no larger than the pages the rows hold, the rest of the call (prefills, admission)
  as admission's measured."""
  rows, seconds = [], []
  for name, calls in measured.items():
    trace, _ = runs[name]
    for call in calls:
      if len(call["chunk_s"]) != trace.steps_C.size:
        raise SystemExit(f"{name}: {len(call['chunk_s'])} chunks ran, the schedule's "
                         f"simulation has {trace.steps_C.size}")
      rows += zip(trace.steps_C * trace.slots_C, trace.steps_C,
                  trace.steps_C * trace.pool_pages_C, np.ones_like(trace.steps_C))
      seconds += call["chunk_s"]
  x_CxF, y_C = np.array(rows, np.float64), np.array(seconds)
  coef_F = np.linalg.lstsq(x_CxF, y_C, rcond=None)[0]
  trace, _ = runs["admission"]
  rest = statistics.median(c["seconds"] - sum(c["chunk_s"]) for c in measured["admission"])
  bound = (coef_F[0] * (trace.steps_C * trace.rows_C).sum() + coef_F[1] * lengths_R.max()
           + coef_F[2] * (trace.steps_C * trace.held_pages_C).sum() + rest)
  today = statistics.median(c["seconds"] for c in measured["today"])
  return dict(
      ms_per_slot_step=coef_F[0] * 1e3, ms_per_step=coef_F[1] * 1e3,
      ms_per_pool_page_step=coef_F[2] * 1e3, ms_per_chunk=coef_F[3] * 1e3,
      median_relative_error=float(np.median(np.abs(x_CxF @ coef_F - y_C) / y_C)),
      least_admission_s=float(bound), today_s=today, best_speedup=float(today / bound))


if __name__ == "__main__":
  main()
