r"""XLA's memory analysis of the learner step at Qwen2.5-7B layer shapes, per attention.

Shown in docs/aot.md ("Two facts behind the figures").

  python scripts/bench/bench_attention_memory.py [--lengths=2304,4608,9216] \
      [--attention=xla,blockwise] [--layers=2]

Compiles (never runs) `learner.train_step` for one micro-batch of one sequence of S tokens
(prompt S/9, response 8S/9, as configs/qwen7b.py's 1024 + 8192) on ShapeDtypeStructs, with
Qwen2.5-Math-7B's layer shapes (28 query heads, 4 KV heads, D=3584, F=18944,
V=152,064), `--layers` layers, and configs/qwen7b.py's dtypes, remat and optimizer.
Prints JSON: per attention and S, `compiled.memory_analysis()` in GiB (temp = XLA's
working memory beyond the arguments and outputs) of the whole step and of one
micro-batch's loss gradient (the part that grows with S), temp's growth per step of S,
xla's temp over this attention's, and the compile time.
"""

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from configs import qwen7b  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.training import learner  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.models import published  # pylint: disable=g-import-not-at-top,wrong-import-position

GIB = 2 ** 30


def model_config(config, layers: int, attention: str) -> models.ModelConfig:
  hf = published.HF_CONFIGS["Qwen2.5-Math-7B-16k-think"]
  return models.from_hf_config(dict(hf, num_hidden_layers=layers), dtype=config.model.dtype,
                               param_dtype=config.model.param_dtype,
                               remat=config.model.remat, attention=attention)


def abstract_batch(S: int) -> learner.TrainBatch:
  P = S // 9
  R = S - P
  sds = jax.ShapeDtypeStruct
  return learner.TrainBatch(
      tokens_MxBxT=sds((1, 1, S), jnp.int32), segment_ids_MxBxT=sds((1, 1, S), jnp.int32),
      index_MxBxR=sds((1, 1, R), jnp.int32), mask_MxBxR=sds((1, 1, R), bool),
      old_logp_MxBxR=sds((1, 1, R), jnp.float32), adv_MxBxR=sds((1, 1, R), jnp.float32),
      is_replay_MxBxR=sds((1, 1, R), bool), weight_MxBxR=sds((1, 1, R), jnp.float32))


def _memory(lowered) -> dict:
  start = time.perf_counter()
  m = lowered.compile().memory_analysis()
  return dict(temp_gib=round(m.temp_size_in_bytes / GIB, 3),
              argument_gib=round(m.argument_size_in_bytes / GIB, 3),
              output_gib=round(m.output_size_in_bytes / GIB, 3),
              alias_gib=round(m.alias_size_in_bytes / GIB, 3),
              compile_seconds=round(time.perf_counter() - start, 1))


def analyse(config, cfg, S: int) -> dict:
  """`step`: the whole optimizer step (gradient accumulator and AdamW temporaries
  included); `micro`: the value and gradient of one micro-batch's loss inside it."""
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  placed = lambda tree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
  params = placed(models.abstract_params(cfg))
  opt_state = placed(jax.eval_shape(learner.make_optimizer(config.optim).init, params))
  batch = abstract_batch(S)
  kw = dict(cfg=cfg, algo=learner.frozen(config.algo), use_clip=True,
            chunk=config.train.logprob_chunk)
  # The jitted program `learner.train_step` dispatches to for arrays with these shardings.
  step = learner.step_program(params, opt_state)
  step_memory = _memory(step.lower(params, opt_state, batch,
                                   optim=learner.frozen(config.optim), **kw))
  micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch)
  micro_grad = jax.value_and_grad(functools.partial(
      learner._micro_loss, num_tokens=1, **kw), has_aux=True)  # pylint: disable=protected-access
  micro_memory = _memory(jax.jit(micro_grad).lower(params, micro))
  return dict(S=S, step=step_memory, micro=micro_memory)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="2304,4608,9216")
  parser.add_argument("--attention", default="xla,blockwise")
  parser.add_argument("--layers", type=int, default=2)
  args = parser.parse_args()
  config = qwen7b.get_config()
  results = dict(device=str(jax.devices()[0]), layers=args.layers,
                 dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                 remat=config.model.remat, attention={})
  for attention in args.attention.split(","):
    cfg = model_config(config, args.layers, attention)
    rows = [analyse(config, cfg, int(S)) for S in args.lengths.split(",")]
    for prev, row in zip(rows, rows[1:]):
      for program in ("step", "micro"):
        row[program]["temp_growth"] = round(
            row[program]["temp_gib"] / prev[program]["temp_gib"], 2)
    results["attention"][attention] = rows
  if "xla" in results["attention"]:
    xla = results["attention"]["xla"]
    for rows in results["attention"].values():
      for row, ref in zip(rows, xla):
        for program in ("step", "micro"):
          row[program]["xla_temp_over_this"] = round(
              ref[program]["temp_gib"] / row[program]["temp_gib"], 2)
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
