r"""The analytic memory plan (scripts/memory_plan.py) against the compiler's figures.

  python scripts/memory_plan_vs_aot.py docs/results/aot_*.json

For every compile of every AOT plan (scripts/aot_plan.py: each mesh, micro-batch and
rows per call its search tried), the analytic learner and rollout peaks for the same
config, machine and settings, against the compiler's per-device peaks (with what stays
beside each program) of the learner step and of the largest rollout program; the error
is (analytic - compiler) / compiler.
"""

import importlib
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

from exgrpo_jax import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import sharding  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.aot import targets  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.models import published  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.training import padding  # pylint: disable=g-import-not-at-top,wrong-import-position
from scripts import memory_plan  # pylint: disable=g-import-not-at-top,wrong-import-position

GIB = 2 ** 30


def analytic(name: str, target: str, devices: int, tensor: int, micro: int, rows: int):
  """memory_plan.py's learner and rollout peaks (GiB per device) for these settings."""
  c = importlib.import_module(f"configs.{name}").get_config()
  hf = published.HF_CONFIGS[os.path.basename(c.model.path)]
  cfg = models.from_hf_config(hf, dtype=c.model.dtype, param_dtype=c.model.param_dtype,
                              remat=c.model.remat)
  mesh = jax.sharding.AbstractMesh((devices // tensor, tensor), ("fsdp", "tensor"))
  shards = sharding.batch_shards(mesh)
  gpu = target.startswith("h")
  params = memory_plan.shard_bytes(cfg, mesh, sharding.LEARNER_RULES, cfg.param_dtype)
  sampler = memory_plan.shard_bytes(cfg, mesh, sharding.SAMPLER_RULES, cfg.dtype)
  seq = padding.prompt_bucket(c.data.max_prompt_tokens) + c.rollout.max_new_tokens
  seqs = micro // shards if micro % shards == 0 else micro
  learner = 6 * params + memory_plan.activation_bytes(
      cfg, seqs, seq, tensor, c.model.remat, c.train.logprob_chunk, gpu)
  split = lambda n: n // shards if n % shards == 0 else n
  kv_t = cfg.num_kv_heads // tensor if cfg.num_kv_heads % tensor == 0 else cfg.num_kv_heads
  h_t = cfg.num_heads // tensor if cfg.num_heads % tensor == 0 else cfg.num_heads
  act = 2 if cfg.dtype != "float32" else 4
  kv_row = 2 * cfg.num_layers * kv_t * cfg.head_dim * seq * act
  prompts = max(rows // c.rollout.k, 1)
  rollout = (3 * params + sampler + (split(rows) + split(prompts)) * kv_row
             + split(prompts) * memory_plan.attention_bytes(
                 padding.prompt_bucket(c.data.max_prompt_tokens), seq, h_t, kv_t,
                 cfg.head_dim, act, gpu))
  return learner / GIB, rollout / GIB


def main(paths) -> None:
  rows = []
  for path in sorted(paths):
    with open(path, encoding="utf-8") as f:
      p = json.load(f)
    if "search" not in p:
      continue
    name = p["config"].removeprefix("configs/").removesuffix(".py")
    devices = targets.get(p["target"]).devices
    for s in p["search"]:
      peaks = {k: v for k, v in s["device_peak_gib"].items() if v is not None}
      if not peaks:
        continue
      learner, rollout = analytic(name, p["target"], devices, s["tensor"],
                                  s["micro_batch_size"], s["max_rows"])
      row = dict(config=name, target=p["target"], tensor=s["tensor"],
                 micro_batch_size=s["micro_batch_size"], max_rows=s["max_rows"])
      if "learner_step" in peaks:
        row.update(learner_analytic_gib=learner, learner_compiler_gib=peaks["learner_step"],
                   learner_error=learner / peaks["learner_step"] - 1)
      rollout_peaks = {k: v for k, v in peaks.items() if k not in ("learner_step", "score")}
      if rollout_peaks:
        top = max(rollout_peaks, key=rollout_peaks.get)
        row.update(rollout_analytic_gib=rollout, rollout_compiler_gib=rollout_peaks[top],
                   rollout_program=top, rollout_error=rollout / rollout_peaks[top] - 1)
      rows.append(row)
  errors = [abs(r[k]) for r in rows for k in ("learner_error", "rollout_error") if k in r]
  print(json.dumps(dict(max_abs_error=max(errors, default=None), points=rows), indent=1))


if __name__ == "__main__":
  main(sys.argv[1:])
