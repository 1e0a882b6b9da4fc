"""Replay-buffer benchmark at the paper's scale; prints JSON.

A developer tool: it writes no published result.

Fills an ExperienceBuffer with `--trajectories` correct responses of `--length` tokens
(vocabulary `--vocab`) through ordinary `update` calls of 128 questions x 8 responses with
1..7 correct each, then reports:
  * memory: live payload bytes, allocated bytes, and the process RSS growth;
  * storage precision: relative error of importance ratios exp(logp_new - logp_stored)
    caused by log-prob storage, for our uint16 log-domain code and, for comparison,
    float16 and bfloat16;
  * time: `update` of a 1024-response batch and `sample_questions(64)` on the full buffer
    (median after warm-up; the fill itself is the warm-up), `candidates`, `state_dict`.

  python scripts/bench/bench_replay.py [--trajectories=200000 --length=1000 --vocab=152064]
"""

import argparse
import json
import os
import time

import numpy as np

from exgrpo_jax import replay
from exgrpo_jax.replay import storage

K, QUESTIONS_PER_BATCH = 8, 128


def rss_bytes() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no VmRSS in /proc/self/status")


def realistic_logps(rng, n):
  """Sampled-token log-probs: mostly confident tokens, a heavy tail of unlikely ones."""
  confident = -rng.exponential(0.05, n)
  unlikely = -rng.exponential(3.0, n)
  return np.where(rng.random(n) < 0.8, confident, unlikely)


def ratio_errors(logp_true):
  """Max and mean |exp(stored - true) - 1| for each storage format (float32 inputs, as
  the trainer records them)."""
  logp_true = logp_true.astype(np.float32)
  formats = {
      "uint16_log_domain": storage.decode_logps(storage.encode_logps(logp_true)[0]),
      "float16": logp_true.astype(np.float16),
      "bfloat16": _bfloat16_round_trip(logp_true),
  }
  out = {}
  for name, stored in formats.items():
    err = np.abs(np.expm1(stored.astype(np.float64) - logp_true.astype(np.float64)))
    out[name] = dict(max=float(err.max()), mean=float(err.mean()))
  return out


def _bfloat16_round_trip(x):
  bits = x.astype(np.float32).view(np.uint32)
  rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even
  return rounded.astype(np.uint32).view(np.float32)


class BatchMaker:
  """Batches of K responses per question, sliced from one random token/log-prob pool."""

  def __init__(self, rng, length, vocab):
    self.rng, self.length = rng, length
    self.pool_ids = rng.integers(0, vocab, 4_000_000).astype(np.int32)
    self.pool_logps = realistic_logps(rng, len(self.pool_ids)).astype(np.float32)
    self.next_qid = 0

  def __call__(self):
    qids = np.arange(self.next_qid, self.next_qid + QUESTIONS_PER_BATCH)
    self.next_qid += QUESTIONS_PER_BATCH
    num_correct = self.rng.integers(1, K, QUESTIONS_PER_BATCH)
    rewards = (np.arange(K)[None, :] < num_correct[:, None]).astype(np.float64)
    starts = self.rng.integers(0, len(self.pool_ids) - self.length, (QUESTIONS_PER_BATCH, K))
    groups = [[(self.pool_ids[s:s + self.length], self.pool_logps[s:s + self.length])
               for s in row] for row in starts]
    return qids, rewards, groups


def median_ms(fn, repeats):
  """Median and max wall-clock ms, and median process CPU ms (the machine may be shared)."""
  wall, cpu = [], []
  for _ in range(repeats):
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    wall.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  return dict(median=1e3 * float(np.median(wall)), max=1e3 * float(np.max(wall)),
              cpu_median=1e3 * float(np.median(cpu)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--trajectories", type=int, default=200_000)
  parser.add_argument("--length", type=int, default=1000)
  parser.add_argument("--vocab", type=int, default=152064)
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  make_batch = BatchMaker(rng, args.length, args.vocab)
  rss_before = rss_bytes()
  buf = replay.ExperienceBuffer(dict(k=K, vocab_size=args.vocab), seed=0)
  step, fill_start = 0, time.perf_counter()
  while buf.stats()["trajectories"] < args.trajectories:
    buf.update(*make_batch(), step=step)
    step += 1
  fill_seconds = time.perf_counter() - fill_start
  stats = buf.stats()
  rss_growth = rss_bytes() - rss_before

  batches = [make_batch() for _ in range(args.repeats)]
  update_ms = median_ms(lambda: buf.update(*batches.pop(), step=step), args.repeats)
  sample_ms = median_ms(lambda: buf.sample_questions(64), 10 * args.repeats)
  qids = buf.sample_questions(64)
  candidates_ms = median_ms(lambda: [buf.candidates(q) for q in qids], args.repeats)
  start = time.perf_counter()
  state = buf.state_dict()
  state_dict_seconds = time.perf_counter() - start

  tokens = stats["tokens"]
  results = dict(
      trajectories=stats["trajectories"], tokens=tokens, questions=stats["questions"],
      vocab_size=args.vocab, fill_updates=step, fill_seconds=fill_seconds,
      memory=dict(
          live_bytes=stats["bytes"], allocated_bytes=stats["allocated_bytes"],
          rss_growth_bytes=rss_growth, live_bytes_per_token=stats["bytes"] / tokens,
          rss_bytes_per_token=rss_growth / tokens,
          state_dict_bytes=int(sum(a.nbytes for a in state.values())),
          target_bytes=1.25e9, paper_bytes_per_token_estimate=8),
      ratio_error_from_storage=dict(
          realistic=ratio_errors(realistic_logps(rng, 2_000_000)),
          uniform_minus_64_to_0=ratio_errors(np.linspace(storage.LOGP_MIN, 0.0, 2_000_001)),
          target_max=1e-3),
      time_ms=dict(
          update_1024_responses=update_ms, sample_questions_64=sample_ms,
          candidates_of_64_questions=candidates_ms, state_dict=1e3 * state_dict_seconds,
          target_ms=10, load_average=os.getloadavg()),
  )
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
