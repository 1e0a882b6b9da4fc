"""Memory (and CPU time) of chunked vs naive log-prob/entropy computation; prints JSON.

A developer tool: it writes no published result (tests/logprobs_test.py leaves the
bfloat16 backward pass to it).

Memory comes from XLA's compiled memory analysis (compile only, nothing is allocated), at
Qwen2.5-Math-7B's unembedding shape by default: B=2, T=4096, D=3584, V=152,064. "temp" is
the working memory XLA allocates beyond the arguments (hidden states, unembedding) and the
outputs, which both paths share. Timing runs at a reduced size (`--time_*`), after a
warm-up call (compile excluded), median of `--repeats` runs.

  python scripts/bench/bench_logprobs.py [--chunk_sizes=256,1024] [--dtypes=float32,bfloat16]
"""

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp

from exgrpo_jax import logprobs


def with_grad(fn):
  """d(sum(logp) + sum(entropy)) / d(hidden, unembed)."""
  return jax.grad(lambda h, u, t: sum(x.sum() for x in fn(h, u, t)), argnums=(0, 1))


def memory(fn, B, T, D, V, dtype):
  args = (jax.ShapeDtypeStruct((B, T, D), dtype), jax.ShapeDtypeStruct((D, V), dtype),
          jax.ShapeDtypeStruct((B, T), jnp.int32))
  analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
  return dict(temp_bytes=analysis.temp_size_in_bytes,
              argument_bytes=analysis.argument_size_in_bytes,
              output_bytes=analysis.output_size_in_bytes)


def median_seconds(fn, args, repeats):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return sorted(times)[len(times) // 2]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--length", type=int, default=4096)
  parser.add_argument("--hidden", type=int, default=3584)
  parser.add_argument("--vocab", type=int, default=152064)
  parser.add_argument("--chunk_sizes", default="256,1024")
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--time_length", type=int, default=256)
  parser.add_argument("--time_hidden", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  shape = (args.batch, args.length, args.hidden, args.vocab)
  results = dict(device=str(jax.devices()[0]), shape=dict(zip("BTDV", shape)), memory=[],
                 timing=[])
  chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
  for dtype_name in args.dtypes.split(","):
    dtype = jnp.dtype(dtype_name)
    for mode, wrap in (("forward", lambda f: f), ("forward+backward", with_grad)):
      base = memory(wrap(logprobs.full_logits_logprobs_and_entropy), *shape, dtype)
      results["memory"].append(dict(dtype=dtype_name, mode=mode, path="naive", **base))
      for chunk in chunk_sizes:
        fn = functools.partial(logprobs.token_logprobs_and_entropy, chunk_size=chunk)
        row = memory(wrap(fn), *shape, dtype)
        results["memory"].append(dict(dtype=dtype_name, mode=mode, path=f"chunked_{chunk}",
                                      temp_ratio_to_naive=row["temp_bytes"] / base["temp_bytes"],
                                      **row))
  keys = jax.random.split(jax.random.key(0), 3)
  small = (args.batch, args.time_length, args.time_hidden, args.vocab)
  inputs = (jax.random.normal(keys[0], small[:3]),
            jax.random.normal(keys[1], small[2:]) * 0.05,
            jax.random.randint(keys[2], small[:2], 0, args.vocab))
  for chunk in chunk_sizes:
    fn = functools.partial(logprobs.token_logprobs_and_entropy, chunk_size=chunk)
    for mode, f in (("forward", fn), ("forward+backward", with_grad(fn))):
      results["timing"].append(dict(path=f"chunked_{chunk}", mode=mode, shape=small,
                                    seconds=median_seconds(jax.jit(f), inputs, args.repeats)))
  for mode, f in (("forward", logprobs.full_logits_logprobs_and_entropy),
                  ("forward+backward", with_grad(logprobs.full_logits_logprobs_and_entropy))):
    results["timing"].append(dict(path="naive", mode=mode, shape=small,
                                  seconds=median_seconds(jax.jit(f), inputs, args.repeats)))
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
