r"""JAX / vLLM split of each GPU of a node for the paper configs with rollout.engine=vllm (JSON).

Shown in docs/vllm.md (the memory split for 8 H100s).

  python scripts/accelerator/vllm_memory_plan.py [--target=h100x8]

With vLLM rollouts JAX no longer samples: per GPU it needs its learner peak in the
learner phase and only the resident state (params + AdamW, their shards) while vLLM
generates. The mesh is the one whose learner step the compiler found smallest among
those the config's AOT plan compiled at its micro-batch
(docs/results/aot_<config>_<target>.json, "search"; pass it as --config.mesh.shape).
vLLM needs its share of the weights in the compute dtype, a working allowance and KV
cache (`exgrpo_jax.sampling.vllm_setup.plan_split`, the same check the engine runs at
start-up).
Two ways to share a GPU, for each tensor_parallel_size:

  static  JAX's default allocator keeps its pool for the run, so
          XLA_PYTHON_CLIENT_MEM_FRACTION = learner peak x 1.1 (room for the allocator's
          fragmentation) and vLLM gets 0.95 minus that.
  sleep   XLA_PYTHON_CLIENT_ALLOCATOR=platform: JAX returns freed memory and vLLM sleeps
          (level 2) through every JAX phase, so vLLM gets 0.95 minus the resident state x
          1.1, and the learner gets the whole GPU while vLLM sleeps.

`kv_sequences` is how many full-length (prompt + response) sequences the KV cache holds
at once per vLLM instance; a step's 1024 rows are shared by gpus / tensor_parallel_size
instances, and vLLM queues what does not fit. vLLM's side is an analytical estimate
(vLLM has not run with this code), JAX's the compiler's figures; neither a measurement.
"""

import argparse
import importlib
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

from exgrpo_jax.aot import analysis  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.aot import targets  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.sampling import vllm_setup  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.training import learner  # pylint: disable=g-import-not-at-top,wrong-import-position

CONFIGS = ("qwen7b", "qwen1_5b", "llama8b")
HEADROOM = 1.1  # JAX's pool over the compiler's peak: the allocator's fragmentation
GIB = 2 ** 30


def _fraction(gib: float, device_gib: float) -> float:
  return math.ceil(100 * gib * HEADROOM / device_gib) / 100


def split(cfg, c, jax_gib: float, device_gib: float, tp: int, jax_keeps: bool) -> dict:
  """One (mode, tp) row: the fractions, and the KV sequences or why it does not fit."""
  jax_fraction = _fraction(jax_gib, device_gib)
  vllm_fraction = round(vllm_setup.MAX_TOTAL_FRACTION - jax_fraction, 2)
  row = dict(tensor_parallel_size=tp, jax_fraction=jax_fraction,
             vllm_fraction=vllm_fraction)
  if vllm_fraction <= 0:
    return dict(row, fits=False, why="JAX alone needs more than 0.95 of the GPU")
  options = vllm_setup.VllmOptions(
      max_model_len=c.data.max_prompt_tokens + c.rollout.max_new_tokens,
      gpu_memory_utilization=vllm_fraction, tensor_parallel_size=tp)
  try:
    s = vllm_setup.plan_split(cfg, options, int(device_gib * vllm_setup.GIB),
                              jax_fraction if jax_keeps else None)
  except ValueError as e:
    return dict(row, fits=False, why=str(e))
  return dict(row, fits=True, vllm_weights_gib=round(s.vllm_weights_gib, 2),
              kv_gib_per_sequence=round(s.kv_gib_per_sequence, 3),
              kv_sequences=s.kv_sequences)


def resident_gib(c, cfg, mesh_shape) -> float:
  """Parameters and AdamW moments per device on a (fsdp, tensor) mesh: their shards."""
  mesh = jax.sharding.AbstractMesh(tuple(mesh_shape), ("fsdp", "tensor"))
  state = learner.abstract_state(cfg, learner.make_optimizer(c.optim), mesh)
  return analysis.shard_bytes(state) / GIB


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--target", default="h100x8", choices=[
      n for n, t in targets.TARGETS.items() if t.platform == "cuda" and t.devices > 1])
  args = parser.parse_args(argv)
  device_gib = targets.get(args.target).hbm_bytes / GIB
  report = {}
  for name in CONFIGS:
    c = importlib.import_module(f"configs.{name}").get_config()
    cfg = check.model_config(c)
    with open(os.path.join(REPO, "docs", "results", f"aot_{name}_{args.target}.json"),
              encoding="utf-8") as f:
      search = json.load(f)["search"]
    # JAX only trains here, so the mesh is the one with the smallest learner peak.
    tensor, peak = min(((s["tensor"], s["device_peak_gib"]["learner_step"]) for s in search
                        if s["micro_batch_size"] == c.optim.micro_batch_size
                        and s["device_peak_gib"].get("learner_step")), key=lambda t: t[1])
    mesh = [targets.get(args.target).devices // tensor, tensor]
    resident = resident_gib(c, cfg, mesh)
    report[name] = dict(
        config=f"configs/{name}.py", target=args.target, device_gib=round(device_gib, 2),
        mesh=mesh, learner_peak_gib=round(peak, 2), resident_gib=round(resident, 2),
        max_model_len=c.data.max_prompt_tokens + c.rollout.max_new_tokens,
        static=[split(cfg, c, peak, device_gib, tp, True) for tp in (1, 2, 4)],
        sleep=[split(cfg, c, resident, device_gib, tp, False) for tp in (1, 2, 4)])
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
