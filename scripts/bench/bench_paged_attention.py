"""Decode attention alone: the dense [B, S] cache against the page pool, at equal tokens.

Shown in docs/sampler_performance.md ("How much is the form of attention").

Separates the two things continuous batching's paged cache changes: how many cached
slots a step reads (fewer: rows read only their own pages), and how fast one slot is
read (the attention's form: B matmuls over S slots, or P over pages of T). Times the
attention of one decode step through `--layers` layers (each layer's output is the next
one's query, so they run in order), with SmolLM2-135M's heads by default, for each dense
cache length S and a pool of the same B x S slots, then for pools of `--pool-slots`.
Median of `--repeats` timings after a warm-up call (compile excluded); prints JSON.

  python scripts/bench/bench_paged_attention.py --batch 8 --slots 756,1032 --pool-slots 5560
"""

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from exgrpo_jax.models import attention  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.sampling import decode_layer  # pylint: disable=g-import-not-at-top,wrong-import-position
from scripts.bench.bench_logprobs import median_seconds  # pylint: disable=g-import-not-at-top,wrong-import-position


def _median_ms(fn, args, repeats: int) -> float:
  return 1e3 * median_seconds(fn, args, repeats)


def dense_ms(a, slots: int) -> float:
  rng = np.random.default_rng(0)
  ks = [jnp.asarray(rng.standard_normal((a.batch, a.kv_heads, a.head_dim, slots)), jnp.float32)
        for _ in range(a.layers)]
  vs = [jnp.asarray(rng.standard_normal((a.batch, a.kv_heads, slots, a.head_dim)), jnp.float32)
        for _ in range(a.layers)]
  mask_Bx1xS = jnp.ones((a.batch, 1, slots), bool)
  q_Bx1xHxDh = jnp.asarray(rng.standard_normal((a.batch, 1, a.heads, a.head_dim)), jnp.float32)

  @jax.jit
  def layers(q, ks, vs):
    for k, v in zip(ks, vs):
      q = attention.einsum_attention(q, k, v, mask_Bx1xS)
    return q

  return _median_ms(layers, (q_Bx1xHxDh, ks, vs), a.repeats)


def paged_ms(a, slots: int) -> float:
  """A pool of `slots` slots (rounded up to whole pages), its pages spread over the rows."""
  rng = np.random.default_rng(0)
  T = a.page_size
  P = -(-slots // T)
  ks = [jnp.asarray(rng.standard_normal((P, a.kv_heads, a.head_dim, T)), jnp.float32)
        for _ in range(a.layers)]
  vs = [jnp.asarray(rng.standard_normal((P, a.kv_heads, T, a.head_dim)), jnp.float32)
        for _ in range(a.layers)]
  owner_P = jnp.asarray(np.sort(np.arange(P) % a.batch), jnp.int32)
  mask_PxT = jnp.ones((P, T), bool)
  q_BxHxDh = jnp.asarray(rng.standard_normal((a.batch, a.heads, a.head_dim)), jnp.float32)

  @jax.jit
  def layers(q, ks, vs):
    for k, v in zip(ks, vs):
      q = decode_layer.paged_attention(q, k, v, owner_P, mask_PxT)
    return q

  return _median_ms(layers, (q_BxHxDh, ks, vs), a.repeats)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--slots", default="756,1032",
                      help="dense cache lengths S (per row), comma-separated")
  parser.add_argument("--pool-slots", default="",
                      help="further pool sizes in slots (all rows together), comma-separated")
  parser.add_argument("--page-size", type=int, default=64)
  parser.add_argument("--layers", type=int, default=30)
  parser.add_argument("--heads", type=int, default=9)
  parser.add_argument("--kv-heads", type=int, default=3)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=20)
  a = parser.parse_args(argv)
  parse = lambda text: [int(x) for x in text.split(",") if x]
  result = dict(device=jax.devices()[0].platform, cpu_count=os.cpu_count(),
                load_average=os.getloadavg(), **vars(a), dense=[], paged=[])
  for S in parse(a.slots):
    ms, pooled = dense_ms(a, S), paged_ms(a, a.batch * S)
    result["dense"].append(dict(slots_per_row=S, ms=ms))
    result["paged"].append(dict(pool_slots=a.batch * S, ms=pooled, dense_over_paged=ms / pooled))
  for slots in parse(a.pool_slots):
    result["paged"].append(dict(pool_slots=slots, ms=paged_ms(a, slots)))
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
