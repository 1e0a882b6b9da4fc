"""Device memory of a page-pool resize (`slots.repage`) against the static loop's KV cache.

Shown in docs/sampler_performance.md ("Continuous batching").

  python scripts/bench/bench_repage_memory.py [--layers 4] [--rows 8] [--new-tokens 1024]

Runs one continuous rollout of a small random model (EOS ignored, so the pool grows to
its largest) and, at every resize, measures two ways of moving the pool, in bytes over
the static loop's KV cache for the same rows (B x (L + N) slots of every layer's k and
v):

* `layer_by_layer` (what `slots.repage` does): the pool arrays alive on the device after
  each layer's move (`jax.live_arrays()`), at their most during that resize;
* `whole_pool` (the baseline, one program over every layer): XLA's
  `compiled.memory_analysis()` of that program for the same shapes, arguments plus
  outputs plus temporaries (XLA keeps a program's arguments to its end).

For reference, the static loop's decode program (`decode.generate`, phases included):
its temporaries, which hold its cache. Compile only for the baseline; nothing is timed. Prints JSON.
"""

import argparse
import json

import jax
import jax.numpy as jnp

from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax.sampling import slots as slots_lib


def _bytes(memory) -> int:
  return (memory.argument_size_in_bytes + memory.output_size_in_bytes
          + memory.temp_size_in_bytes - memory.alias_size_in_bytes)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--new-tokens", type=int, default=1024)
  p.add_argument("--page-size", type=int, default=64)
  args = p.parse_args(argv)
  cfg = models.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_layers=args.layers, num_heads=4, num_kv_heads=2, head_dim=64,
                           eos_token_id=(1,), pad_token_id=0,
                           max_position_embeddings=args.new_tokens + 64)
  params = models.init_params(cfg, jax.random.key(0))
  prompts = [list(range(2, 30))] * args.rows
  config = sampling.SamplingConfig(max_new_tokens=args.new_tokens)

  static = sampling.make_engine("jax", cfg, None, scheduler="static", ignore_eos=True)
  static.generate(prompts, 1, params, jax.random.key(0), config)
  prompt_len = static._prompt_bucket(prompts, range(len(prompts)))  # pylint: disable=protected-access
  cache = (2 * cfg.num_layers * args.rows * cfg.num_kv_heads * cfg.head_dim
           * (prompt_len + args.new_tokens) * jnp.dtype(cfg.dtype).itemsize)

  engine = sampling.make_engine("jax", cfg, None, continuous_from=0, ignore_eos=True,
                                page_size=args.page_size)
  page_shapes = {(cfg.num_kv_heads, cfg.head_dim, args.page_size),
                 (cfg.num_kv_heads, args.page_size, cfg.head_dim)}
  resizes, compiled = [], engine.compiled

  def measured(program, call_args, static_args, takes_cfg=True):
    run = compiled(program, call_args, static_args, takes_cfg)
    if program is not slots_lib.repage_layer:
      return run
    layer, source_Q = call_args
    whole = jax.jit(lambda caches, s: tuple(
        tuple(jnp.take(x, s, axis=0, mode="fill", fill_value=0) for x in c) for c in caches))
    pool = (layer,) * cfg.num_layers
    resize = dict(old_pages=layer[0].shape[0], new_pages=source_Q.shape[0],
                  whole_pool=_bytes(whole.lower(pool, source_Q).compile().memory_analysis())
                  / cache, layer_by_layer=0.0)
    resizes.append(resize)

    def run_and_count(one_layer, source):
      out = jax.block_until_ready(run(one_layer, source))
      live = sum(x.nbytes for x in jax.live_arrays() if x.shape[1:] in page_shapes)
      resize["layer_by_layer"] = max(resize["layer_by_layer"], live / cache)
      return out
    return run_and_count

  engine.compiled = measured
  engine.generate(prompts, 1, params, jax.random.key(0), config)
  print(json.dumps(dict(
      layers=args.layers, rows=args.rows, new_tokens=args.new_tokens,
      page_size=args.page_size, static_cache_bytes=int(cache),
      static_loop_temp=static.stats["memory"]["temp"] / cache,
      max_whole_pool=max(r["whole_pool"] for r in resizes),
      max_layer_by_layer=max(r["layer_by_layer"] for r in resizes),
      resizes=resizes), indent=2))


if __name__ == "__main__":
  main()
