r"""Packed vs padded learner step (and scoring pass) time, as ratios in one process.

Shown in docs/algorithm.md §12 (docs/results/bench_packing_cpu_*.json).

  python scripts/bench/bench_packing.py \
      [--lengths=docs/results/smollm2_gsm8k_rollout_lengths.json] [--responses=32] \
      [--micro-batch=4] [--max-new-tokens=512] [--repeats=5]

A mini-batch of `--responses` sequences whose prompt and response lengths are drawn
(seeded, with replacement) from real rollouts recorded by
scripts/bench/record_rollout_lengths.py; without `--lengths`, from the stated synthetic
distribution (`SYNTHETIC`). Token ids are random, the model is a small random decoder
(`--hidden`, `--layers`, `--vocab`). Both layouts go through the same learner
(`learner.train_step` on `packing.train_batch(pack=True|False)`, the same compiled shapes)
and `experience.score_rows`. Each variant gets one unmeasured warm-up call (compile
excluded), then the variants alternate, so machine load hits both alike; medians of
`--repeats` timed calls. Prints JSON.
"""

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from configs import common  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.training import experience  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.training import learner  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.training import packing  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.training import padding  # pylint: disable=g-import-not-at-top,wrong-import-position

# Used without --lengths: GSM8K-like chat prompts and long-tailed responses, mean about
# 0.4 x the cap, about 5% truncated.
SYNTHETIC = "prompt ~ U[80, 180]; response ~ min(cap, ceil(LogNormal(log(0.3 cap), 0.7)))"


def lengths(args, rng) -> tuple[np.ndarray, np.ndarray, str]:
  """(prompt_lens, response_lens) of `--responses` sequences, and where they come from."""
  if args.lengths:
    with open(args.lengths) as f:
      recorded = json.load(f)
    pick = rng.integers(0, len(recorded["response_lens"]), args.responses)
    return (np.asarray(recorded["prompt_lens"])[pick],
            np.minimum(np.asarray(recorded["response_lens"])[pick], args.max_new_tokens),
            args.lengths)
  cap = args.max_new_tokens
  response = np.ceil(rng.lognormal(np.log(0.3 * cap), 0.7, args.responses))
  return (rng.integers(80, 181, args.responses),
          np.minimum(response, cap).astype(int), SYNTHETIC)


def timed(fn) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="")
  parser.add_argument("--responses", type=int, default=32)
  parser.add_argument("--micro-batch", type=int, default=4)
  parser.add_argument("--max-new-tokens", type=int, default=512)
  parser.add_argument("--hidden", type=int, default=128)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=8192)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  rng = np.random.default_rng(args.seed)
  prompt_lens, response_lens, source = lengths(args, rng)
  R = args.max_new_tokens
  cfg = models.ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                           intermediate_size=4 * args.hidden, num_layers=args.layers,
                           num_heads=args.hidden // 32, num_kv_heads=max(1, args.hidden // 64),
                           head_dim=32, eos_token_id=(1,))
  config = common.base_config()
  config.algo.norm_len = R
  optim = config.optim
  responses = [packing.Sequence(rng.integers(2, args.vocab, p), rng.integers(2, args.vocab, r),
                                rng.normal(-3, 0.5, r), float(rng.normal()), False)
               for p, r in zip(prompt_lens, response_lens)]
  P = padding.prompt_bucket(int(prompt_lens.max()))
  num_micro = -(-len(responses) // args.micro_batch)
  batches = {pack: packing.train_batch(
      responses, prompt_len=P, response_len=R, micro_batch=args.micro_batch,
      num_micro=num_micro, pad_id=0, aggregation=config.algo.aggregation, norm_len=R,
      pack=pack) for pack in (True, False)}
  tx = learner.make_optimizer(optim)
  state = {}
  # Committed arrays, as the trainer's: the step's outputs are, and uncommitted first
  # inputs would compile the step a second time.
  device = jax.devices()[0]
  for pack in (True, False):
    params = jax.device_put(models.init_params(cfg, jax.random.key(0)), device)
    state[pack] = (params, jax.device_put(tx.init(params), device))
  static = dict(cfg=cfg, algo=learner.frozen(config.algo), optim=learner.frozen(optim),
                use_clip=True, chunk=config.train.logprob_chunk)

  def step(pack):
    params, opt_state, metrics = learner.train_step(*state[pack], batches[pack], **static)
    state[pack] = (params, opt_state)
    return metrics

  rows = [(r.prompt, r.tokens, None) for r in responses]

  def score(pack):
    return experience.score_rows(rows, cfg=cfg, params=state[pack][0], max_new_tokens=R,
                                 batch_size=args.micro_batch, pad_id=0,
                                 chunk=config.train.logprob_chunk, pack=pack)

  times = {(kind, pack): [] for kind in ("step", "score") for pack in (True, False)}
  fns = {"step": step, "score": score}
  for (kind, pack) in times:  # warm-up: compiles
    timed(lambda: fns[kind](pack))
  for _ in range(args.repeats):
    for (kind, pack), t in times.items():
      t.append(timed(lambda: fns[kind](pack)))
  median = {key: statistics.median(t) for key, t in times.items()}
  used_rows = {pack: int(np.asarray(b.mask_MxBxR).any(-1).sum()) for pack, b in batches.items()}
  print(json.dumps(dict(
      device=str(jax.devices()[0]), load_average=os.getloadavg(),
      timing=f"median of {args.repeats} calls after a warm-up call (compile excluded), "
             "variants interleaved",
      lengths=dict(source=source, responses=len(responses), prompt_bucket=P,
                   max_new_tokens=R, response_mean=float(response_lens.mean()),
                   response_median=float(np.median(response_lens)),
                   prompt_mean=float(prompt_lens.mean()),
                   truncated=int((response_lens >= R).sum())),
      model=dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                 attention=cfg.attention),
      micro_batch_rows=args.micro_batch,
      rows=dict(packed=used_rows[True], padded=used_rows[False]),
      micro_batches=dict(packed=-(-used_rows[True] // args.micro_batch), padded=num_micro),
      seconds={f"{kind}_{'packed' if pack else 'padded'}": round(m, 4)
               for (kind, pack), m in median.items()},
      all_seconds={f"{kind}_{'packed' if pack else 'padded'}": [round(x, 4) for x in t]
                   for (kind, pack), t in times.items()},
      packed_over_padded=dict(
          step=round(median["step", True] / median["step", False], 3),
          score=round(median["score", True] / median["score", False], 3))), indent=1))


if __name__ == "__main__":
  main()
