r"""JAX / vLLM split of each 80 GiB GPU for the paper configs with rollout.engine=vllm (JSON).

  python scripts/vllm_memory_plan.py [--device_gib=80] [--gpus=8]

With vLLM rollouts JAX no longer samples: per GPU it needs its learner peak (from
scripts/memory_plan.py, the config's mesh over 8 GPUs) in the learner phase and only the
resident state (params + AdamW) while vLLM generates. vLLM needs its share of the weights
in the compute dtype, a working allowance and KV cache
(`exgrpo_jax.sampling.vllm_setup.plan_split`, the same check the engine runs at start-up).
Two ways to share a GPU, for each tensor_parallel_size:

  static  JAX's default allocator keeps its pool for the run, so
          XLA_PYTHON_CLIENT_MEM_FRACTION = learner peak x 1.1 (XLA's temporaries, as
          memory_plan.py's --usable=0.9) and vLLM gets 0.95 minus that.
  sleep   XLA_PYTHON_CLIENT_ALLOCATOR=platform: JAX returns freed memory and vLLM sleeps
          (level 2) through every JAX phase, so vLLM gets 0.95 minus the resident state x
          1.1, and the learner gets the whole GPU while vLLM sleeps.

`kv_sequences` is how many full-length (prompt + response) sequences the KV cache holds
at once per vLLM instance; a step's 1024 rows are shared by gpus / tensor_parallel_size
instances, and vLLM queues what does not fit. Analytical estimates, not measurements.
"""

import argparse
import importlib
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import memory_plan  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.sampling import vllm_setup  # pylint: disable=g-import-not-at-top,wrong-import-position

HEADROOM = 1.1  # JAX's pool over its planned peak: XLA's own temporaries


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


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--device_gib", type=float, default=80)
  parser.add_argument("--gpus", type=int, default=8)
  args = parser.parse_args(argv)
  report = {}
  for name, (config_name, hf) in memory_plan.HF_CONFIGS.items():
    c = importlib.import_module(f"configs.{config_name}").get_config()
    cfg = models.from_hf_config(hf, dtype=c.model.dtype, param_dtype=c.model.param_dtype,
                                remat=c.model.remat)
    tensor = c.mesh.shape[1]
    learner = memory_plan.plan(cfg, c, args.gpus, tensor, args.device_gib,
                               gpu=True)["gib_per_device"]
    resident = learner["params"] + learner["adamw"]
    report[name] = dict(
        config=f"configs/{config_name}.py", mesh=[args.gpus // tensor, tensor],
        learner_peak_gib=learner["learner_peak"], resident_gib=round(resident, 2),
        max_model_len=c.data.max_prompt_tokens + c.rollout.max_new_tokens,
        static=[split(cfg, c, learner["learner_peak"], args.device_gib, tp, True)
                for tp in (1, 2, 4)],
        sleep=[split(cfg, c, resident, args.device_gib, tp, False) for tp in (1, 2, 4)])
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
