r"""Llama-3.1-8B with LoRA: the paper's run (configs/llama8b.py) on one GPU or a v5e-8.

  python -m exgrpo_jax.train --config=configs/llama8b_lora.py --workdir=runs/llama8b_lora \
      [the planner's flags for your device: docs/aot.md, "LoRA on small hardware"]

The base is frozen in bfloat16 (the compute dtype; `model.param_dtype`) and rank-16
adapters (alpha 16) train on every attention and MLP projection, at 10 times the full
fine-tuning learning rate (docs/lora.md). Everything else is configs/llama8b.py's. The
mesh, rollout slots and KV pool come from `python -m exgrpo_jax.aot plan` for the device.
"""

from configs import llama8b


def get_config(arg=None):
  c = llama8b.get_config(arg)
  c.model.param_dtype = "bfloat16"
  c.model.lora.rank = 16
  c.model.lora.alpha = 16.0
  c.optim.lr = 1e-5
  c.mesh.shape = (-1, 1)
  c.rollout.max_rows = 0
  c.rollout.kv_pages = 0
  return c
