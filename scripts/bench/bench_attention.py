r"""CPU time of the attention implementations, as ratios to `xla` in one process (JSON).

Shown in docs/aot.md ("Two facts behind the figures"; docs/results/bench_attention_cpu.json).

  python scripts/bench/bench_attention.py [--lengths=512,1024,2048,4096] [--repeats=5]

For each S: forward + backward (d/d params of a scalar of the final hidden states) of a
small random-weight model (2 layers, D=256, 4 query / 2 KV heads of 64, float32), batch 1,
one sequence of S tokens; the implementations run interleaved, after one warm-up call each
(compile excluded), median of `--repeats`. Also the sampler's two attention uses:
prefill of a `--prompt`-token prompt into a cache of prompt + `--new_tokens` slots
(`models.apply` with a cache, so the model's attention), and one decode step's attention
(one query per row over the cache, batch 8) with the einsum decode kernel
(`attention.einsum_attention`, what `transformer.attend` runs) against blockwise.
"""

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from exgrpo_jax import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.models import attention  # pylint: disable=g-import-not-at-top,wrong-import-position

SMALL = models.ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)


def interleaved_medians(fns: dict, args_of: dict, repeats: int) -> dict:
  for name, fn in fns.items():
    jax.block_until_ready(fn(*args_of[name]))
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args_of[name]))
      times[name].append(time.perf_counter() - start)
  return {name: float(np.median(t)) for name, t in times.items()}


def train_fn(cfg):
  def loss(params, tokens):
    hidden, _ = models.apply(cfg, params, tokens, return_hidden=True)
    return jnp.mean(hidden.astype(jnp.float32) ** 2)
  return jax.jit(jax.grad(loss))


def prefill_fn(cfg, slots):
  def prefill(params, tokens):
    cache = models.KVCache.zeros(cfg, tokens.shape[0], slots)
    return models.apply(cfg, params, tokens, cache=cache, return_hidden=True)
  return jax.jit(prefill)


def ratios(seconds: dict) -> dict:
  return dict(seconds={k: round(v, 4) for k, v in seconds.items()},
              ratio_to_xla={k: round(v / seconds["xla"], 3) for k, v in seconds.items()})


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="512,1024,2048,4096")
  parser.add_argument("--implementations", default="xla,blockwise")
  parser.add_argument("--prompt", type=int, default=512)
  parser.add_argument("--new_tokens", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  names = args.implementations.split(",")
  params = models.init_params(SMALL, jax.random.key(0))
  results = dict(device=str(jax.devices()[0]), model=dict(
      layers=SMALL.num_layers, D=SMALL.hidden_size, H=SMALL.num_heads,
      K=SMALL.num_kv_heads, Dh=SMALL.head_dim, dtype=SMALL.dtype), train={}, prefill={},
      decode_attention={})
  rng = np.random.default_rng(0)
  for S in map(int, args.lengths.split(",")):
    tokens = jnp.asarray(rng.integers(0, SMALL.vocab_size, (1, S)), jnp.int32)
    fns = {name: train_fn(SMALL.replace(attention=name)) for name in names}
    results["train"][S] = ratios(interleaved_medians(
        fns, {name: (params, tokens) for name in names}, args.repeats))
    print(json.dumps({S: results["train"][S]}), file=sys.stderr)

  slots = args.prompt + args.new_tokens
  prompt = jnp.asarray(rng.integers(0, SMALL.vocab_size, (8, args.prompt)), jnp.int32)
  fns = {name: prefill_fn(SMALL.replace(attention=name), slots) for name in names}
  results["prefill"] = dict(rows=8, prompt=args.prompt, slots=slots, **ratios(
      interleaved_medians(fns, {name: (params, prompt) for name in names}, args.repeats)))

  B, H, K, Dh = 8, SMALL.num_heads, SMALL.num_kv_heads, SMALL.head_dim
  q = jnp.asarray(rng.normal(size=(B, 1, H, Dh)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, K, Dh, slots)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, K, slots, Dh)), jnp.float32)
  mask = attention.AttentionMask.padded(jnp.ones((B, slots), bool), slots - 1)
  einsum = jax.jit(lambda q, k, v, m: attention.einsum_attention(
      q, k, v, m.dense(1)))
  blockwise = jax.jit(functools.partial(attention.attend, "blockwise"))
  results["decode_attention"] = dict(rows=B, slots=slots, **ratios(interleaved_medians(
      {"xla": einsum, "blockwise": blockwise}, {n: (q, k, v, mask) for n in ("xla", "blockwise")},
      args.repeats * 4)))
  results["load_average"] = os.getloadavg()
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
