r"""Per-device memory of ExGRPO training for 7B/8B models on GPU and TPU meshes (JSON).

  python scripts/memory_plan.py [--usable=0.9] [--hf_config=NAME=path/config.json ...]

For Qwen2.5-Math-7B (configs/qwen7b.py) and Llama-3.1-8B (configs/llama8b.py), each
machine (8 x 80 GiB GPUs, TPU v5p-8: 4 x 95 GiB, v4-8: 4 x 32 GiB, and the v4-16/v4-32
pods) and each mesh (fsdp x tensor over all its devices), it prints the bytes per device of:

  params, adamw, grads   the learner's shards (`sharding.LEARNER_RULES`), param_dtype;
                         grads count twice (the accumulator and one micro-batch's);
  update_temp            one more parameter-sized buffer while AdamW updates;
  activations            one micro-batch's forward/backward under the config's remat:
                         the residual stream saved per layer, one recomputed layer
                         (blockwise attention, `models/blockwise.py`: q, k, v, output,
                         float32 log-sum-exp and dq/dk/dv accumulators, O(S), plus four
                         float32 score tiles of H x 512 x 512; on GPUs also cuDNN's
                         S x S bfloat16 mask bias per sequence), and the chunked
                         log-prob logits;
  sampler_params         the rollout copy (`sharding.SAMPLER_RULES`, compute dtype);
  kv_cache               K and V of every layer for the rows (and their prompts) of one
                         `generate` call, S = 1024 prompt + max_new_tokens slots;
  prefill_temp           the prefill's attention for those prompts (as above, without
                         the backward).

Peaks: learner = params + adamw + grads + update_temp + activations; rollout = params +
adamw + sampler_params + kv_cache + prefill_temp (the phases do not overlap). A mesh fits
when both are at most `usable` x the device memory; `max_rows` is the largest rollout
call (`rollout.max_rows`, bucket-aligned) that fits, and `micro_batch_size` the largest
micro-batch (a multiple of the batch shards, at most the config's) that fits. The
recommended mesh keeps the config's micro-batch if it can, then has the largest rollout
call, then the least tensor parallelism; its command-line flags are printed. Analytical estimates
from shapes and dtypes (no compilation); XLA's own temporaries come out of the headroom.
Parameter shards are exact (the rules applied to every tensor).
"""

import argparse
import importlib
import json
import math
import os
import sys

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from exgrpo_jax import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import sharding  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.models import blockwise  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.training import padding  # pylint: disable=g-import-not-at-top,wrong-import-position

GIB = 2 ** 30
# The published config.json fields that set memory (Hugging Face hub). The paper's Qwen
# 7B run uses LUFFY's 16k-context variant; the instruct models share these shapes.
HF_CONFIGS = {
    "Qwen2.5-Math-7B": ("qwen7b", dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        tie_word_embeddings=False, max_position_embeddings=16384)),
    "Qwen2.5-Math-1.5B": ("qwen1_5b", dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        tie_word_embeddings=True, max_position_embeddings=4096)),
    "Llama-3.1-8B": ("llama8b", dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        tie_word_embeddings=False, max_position_embeddings=131072)),
}
MACHINES = {"8x GPU 80GiB (H100/A100)": (8, 80), "TPU v5p-8 (4x 95GiB)": (4, 95),
            "TPU v4-8 (4x 32GiB)": (4, 32), "TPU v4-16 (8x 32GiB, 2 hosts)": (8, 32),
            "TPU v4-32 (16x 32GiB, 4 hosts)": (16, 32)}


def _bytes(dtype: str) -> int:
  return np.dtype(models.config.dtype_from_name(dtype)).itemsize


def _split(size: int, n: int) -> int:
  """Per-device share of a dimension split n ways (unsplit when n does not divide it)."""
  return size // n if size % n == 0 else size


def shard_bytes(cfg, mesh, rules, dtype: str) -> int:
  """Bytes of one device's shards of every parameter under `rules`."""
  total = 0
  axes = jax.tree.leaves(models.logical_axes(cfg), is_leaf=lambda x: isinstance(x, sharding.P))
  for names, x in zip(axes, jax.tree.leaves(models.abstract_params(cfg))):
    spec = sharding.spec(tuple(names), x.shape, mesh, rules)
    ways = math.prod(mesh.shape[a] for entry in spec if entry
                     for a in (entry if isinstance(entry, tuple) else (entry,)))
    total += x.size // ways * _bytes(dtype)
  return total


def attention_bytes(queries: int, keys: int, heads: int, kv_heads: int, head_dim: int,
                    act: int, gpu: bool) -> int:
  """One sequence's attention memory (blockwise; in the learner, a recomputed layer's
  backward): per query q, output, dq and log-sum-exp, per key k, v, dk, dv, four float32
  score tiles, and on GPUs cuDNN's [queries, keys] bfloat16 mask bias."""
  tiles = 4 * heads * blockwise.BLOCK ** 2 * 4
  per_query = heads * head_dim * (2 * act + 4) + heads * 4
  per_key = kv_heads * head_dim * (2 * act + 8)
  return queries * per_query + keys * per_key + tiles + (queries * keys * 2 if gpu else 0)


def activation_bytes(cfg, seqs: int, seq: int, tensor: int, remat: str, logprob_chunk: int,
                     gpu: bool) -> int:
  """One device's learner activations for a micro-batch of `seqs` sequences of `seq`
  tokens: the residual stream saved per layer, one recomputed layer's attention and MLP,
  and the chunked log-prob logits."""
  L, D = cfg.num_layers, cfg.hidden_size
  h_t, kv_t, f_t, v_t = (_split(cfg.num_heads, tensor), _split(cfg.num_kv_heads, tensor),
                         _split(cfg.intermediate_size, tensor), _split(cfg.vocab_size, tensor))
  act = _bytes(cfg.dtype)
  saved = L if remat != "none" else L * 8  # remat off: ~8 tensors per layer
  residual = seqs * saved * seq * D * act
  attention = seqs * attention_bytes(seq, seq, h_t, kv_t, cfg.head_dim, act, gpu)
  mlp = seqs * seq * f_t * act * 4
  logits = 3 * logprob_chunk * v_t * 4
  return residual + attention + mlp + logits


def plan(cfg, c, devices: int, tensor: int, capacity: float, gpu: bool) -> dict:
  """Memory per device of config `c` for model `cfg` on a (devices/tensor, tensor) mesh."""
  mesh = jax.sharding.AbstractMesh((devices // tensor, tensor), ("fsdp", "tensor"))
  batch_shards = sharding.batch_shards(mesh)
  L, H, K, Dh = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  h_t, kv_t = _split(H, tensor), _split(K, tensor)
  act = _bytes(cfg.dtype)
  prompt = padding.prompt_bucket(c.data.max_prompt_tokens)
  seq = prompt + c.rollout.max_new_tokens

  params = shard_bytes(cfg, mesh, sharding.LEARNER_RULES, cfg.param_dtype)
  fixed = dict(params=params, adamw=2 * params, grads=2 * params, update_temp=params,
               sampler_params=shard_bytes(cfg, mesh, sharding.SAMPLER_RULES, cfg.dtype))

  def activations(micro: int) -> int:
    seqs = micro // batch_shards if micro % batch_shards == 0 else micro
    return activation_bytes(cfg, seqs, seq, tensor, c.model.remat, c.train.logprob_chunk, gpu)

  def rollout(rows: int) -> tuple[int, int]:
    rows_dev = rows // batch_shards if rows % batch_shards == 0 else rows
    prompts = max(rows // c.rollout.k, 1)
    prompts_dev = prompts // batch_shards if prompts % batch_shards == 0 else prompts
    kv_row = 2 * L * kv_t * Dh * seq * act
    return ((rows_dev + prompts_dev) * kv_row,
            prompts_dev * attention_bytes(prompt, seq, h_t, kv_t, Dh, act, gpu))

  budget = capacity * GIB
  learner_fixed = params * 6
  rollout_fixed = params * 3 + fixed["sampler_params"]
  micros = range(batch_shards, c.optim.micro_batch_size + 1, batch_shards)
  micro = max((m for m in micros if learner_fixed + activations(m) <= budget), default=0)
  # Calls are bucketed to a power of two up to 64 rows, then a multiple of 64.
  total_rows = c.train.batch_questions * c.rollout.k
  row_options = [r for r in [8, 16, 32] + list(range(64, total_rows + 1, 64))
                 if r % c.rollout.k == 0 and r % batch_shards == 0]
  max_rows = max((r for r in row_options if rollout_fixed + sum(rollout(r)) <= budget),
                 default=0)
  kv, prefill = rollout(max_rows or row_options[0])
  act_bytes = activations(micro or batch_shards)
  sizes = dict(**fixed, activations=act_bytes, kv_cache=kv, prefill_temp=prefill,
               learner_peak=learner_fixed + act_bytes, rollout_peak=rollout_fixed + kv + prefill)
  return dict(mesh=[devices // tensor, tensor], micro_batch_size=micro, max_rows=max_rows,
              fits=bool(micro and max_rows),
              kv_cache_gib_per_row=round(2 * L * kv_t * Dh * seq * act / GIB, 3),
              gib_per_device={k: round(v / GIB, 2) for k, v in sizes.items()})


def recommend(meshes: list[dict], micro_batch_size: int) -> dict | None:
  """The config's micro-batch if possible, then the largest rollout call, then less TP."""
  fitting = [m for m in meshes if m["fits"]]
  if not fitting:
    return None
  best = max(fitting, key=lambda m: (min(m["micro_batch_size"], micro_batch_size),
                                     m["max_rows"], -m["mesh"][1]))
  flags = (f"--config.mesh.shape='({best['mesh'][0]}, {best['mesh'][1]})' "
           f"--config.rollout.max_rows={best['max_rows']}")
  if best["micro_batch_size"] < micro_batch_size:
    flags += f" --config.optim.micro_batch_size={best['micro_batch_size']}"
  return dict(mesh=best["mesh"], micro_batch_size=best["micro_batch_size"],
              max_rows=best["max_rows"], flags=flags)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--usable", type=float, default=0.9,
                      help="fraction of device memory the plan may use")
  parser.add_argument("--hf_config", action="append", default=[],
                      help="NAME=path/config.json[:CONFIG], planned with configs/CONFIG.py "
                           "(default qwen7b)")
  args = parser.parse_args(argv)
  targets = dict(HF_CONFIGS)
  for item in args.hf_config:
    name, path = item.split("=", 1)
    path, _, config_name = path.partition(":")
    with open(path) as f:
      targets[name] = (config_name or "qwen7b", json.load(f))
  report = {}
  for name, (config_name, hf) in targets.items():
    c = importlib.import_module(f"configs.{config_name}").get_config()
    cfg = models.from_hf_config(hf, dtype=c.model.dtype, param_dtype=c.model.param_dtype,
                                remat=c.model.remat)
    entry = dict(config=f"configs/{config_name}.py",
                 params_billion=round(cfg.num_params() / 1e9, 3),
                 dtype=cfg.dtype, param_dtype=cfg.param_dtype, remat=cfg.remat,
                 batch=dict(questions=c.train.batch_questions, k=c.rollout.k,
                            prompt_tokens=c.data.max_prompt_tokens,
                            response_tokens=c.rollout.max_new_tokens,
                            micro_batch_size=c.optim.micro_batch_size),
                 config_mesh=list(c.mesh.shape), machines={})
    for machine, (devices, gib) in MACHINES.items():
      meshes = [plan(cfg, c, devices, t, args.usable * gib, gpu="GPU" in machine)
                for t in (1, 2, 4, 8) if devices % t == 0]
      entry["machines"][machine] = dict(
          device_gib=gib, usable_gib=round(args.usable * gib, 1),
          recommended=recommend(meshes, c.optim.micro_batch_size), meshes=meshes)
    report[name] = entry
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
