r"""One KV budget, two ways to spend it: slots sized for rows at their longest, or
admission by free pages with preemption (`rollout.kv_pages`), side by side (JSON).

  python scripts/bench_admission.py [--rows 256] [--new-tokens 512] [--budget-rows 64]
      [--slots 256] [--repeats 2] [--model PATH]

Both engines hold at most the KV pages of `--budget-rows` rows at their longest (prompt
bucket + `--new-tokens`, pages of 64). Today's engine decodes in `--budget-rows` slots,
each reserving a full-length row; the admission engine decodes in `--slots` slots and
admits rows while pages are free (`rollout.kv_headroom`, `--headroom`), preempting the
newest when they run out. Greedy rollouts of `--rows` chat prompts (one row each) that
end on EOS, so their lengths are the model's own. Calls alternate between the engines,
each once unmeasured first (compiles); the JSON gives each call's new tokens per second
(compile time excluded), preemptions and recomputed tokens, the median ratio
admission / today, and how many rows came out identical.
"""

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from exgrpo_jax import models  # pylint: disable=wrong-import-position
from exgrpo_jax import sampling  # pylint: disable=wrong-import-position
from exgrpo_jax.sampling import decode  # pylint: disable=wrong-import-position
from scripts import bench_sampler  # pylint: disable=wrong-import-position

PAGE = 64
COUNTED = ("compile_s", "new_tokens", "decode_steps", "slot_steps", "preemptions",
           "recomputed_tokens")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="", help="HF dir or .gguf (default: embedded SmolLM2)")
  p.add_argument("--rows", type=int, default=256)
  p.add_argument("--new-tokens", type=int, default=512)
  p.add_argument("--budget-rows", type=int, default=64,
                 help="the KV budget, in rows at their longest")
  p.add_argument("--slots", type=int, default=256, help="the admission engine's slots")
  p.add_argument("--headroom", type=float, default=0.1)
  p.add_argument("--repeats", type=int, default=2)
  args = p.parse_args(argv)
  policy = models.from_pretrained(args.model or None)
  tokenizer = models.load_tokenizer(args.model or None)
  prompts = bench_sampler.chat_prompts(tokenizer, args.rows)
  prompt_len = decode.length_bucket(max(map(len, prompts)), 16)
  per_row = -(-(prompt_len + args.new_tokens) // PAGE)
  engines = {
      "today": sampling.make_engine("jax", policy.config, tokenizer, max_rows=args.budget_rows,
                                    continuous_from=0, page_size=PAGE),
      "admission": sampling.make_engine("jax", policy.config, tokenizer, max_rows=args.slots,
                                        page_size=PAGE, kv_pages=args.budget_rows * per_row,
                                        kv_headroom=args.headroom)}
  config = sampling.SamplingConfig(greedy=True, max_new_tokens=args.new_tokens)
  calls, outs = {name: [] for name in engines}, {}
  for i in range(args.repeats + 1):  # call 0 compiles
    for name, engine in engines.items():
      before, load = {k: engine.stats[k] for k in COUNTED}, os.getloadavg()[0]
      start = time.perf_counter()
      outs[name] = engine.generate(prompts, 1, policy.params, jax.random.key(0), config)
      delta = {k: engine.stats[k] - before[k] for k in COUNTED}
      seconds = time.perf_counter() - start - delta["compile_s"]
      call = dict(delta, seconds=seconds, tokens_per_s=delta["new_tokens"] / seconds,
                  load_before=load, load_after=os.getloadavg()[0], measured=i > 0)
      bench_sampler.log(f"{name} call {i}: {json.dumps(call)}")
      calls[name].append(call)
  same_N = (outs["today"].tokens_NxT == outs["admission"].tokens_NxT).all(1)
  measured = {name: [c for c in c_list if c["measured"]] for name, c_list in calls.items()}
  result = dict(
      model=args.model or "SmolLM2-135M-Instruct (embedded)",
      device=str(jax.devices()[0].device_kind), cpu_count=os.cpu_count(), rows=args.rows,
      new_tokens=args.new_tokens, prompt_bucket=prompt_len, pages_per_row=per_row,
      kv_budget_pages=args.budget_rows * per_row, slots=dict(today=args.budget_rows,
                                                              admission=args.slots),
      headroom=args.headroom, timing="new tokens / s per call, compile excluded",
      mean_length=float(outs["today"].lengths_N.mean()),
      eos_fraction=float(1 - outs["today"].truncated_N.mean()),
      rows_identical=int(same_N.sum()),
      max_logprob_diff=float(np.abs(outs["today"].logprobs_NxT
                                    - outs["admission"].logprobs_NxT).max()),
      calls=calls,
      tokens_per_s={name: statistics.median(c["tokens_per_s"] for c in m)
                    for name, m in measured.items()},
      speedup=statistics.median(a["tokens_per_s"] / t["tokens_per_s"] for t, a in
                                zip(measured["today"], measured["admission"])))
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
