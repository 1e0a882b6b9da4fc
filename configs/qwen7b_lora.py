r"""Qwen2.5-Math-7B with LoRA: the paper's run (configs/qwen7b.py) on one GPU or a v5e-8.

  python -m exgrpo_jax.train --config=configs/qwen7b_lora.py --workdir=runs/qwen7b_lora \
      [the planner's flags for your device: docs/aot.md, "LoRA on small hardware"]

`common.lora_on_small_hardware`: the base frozen in bfloat16, rank-16 adapters (alpha 16)
on every attention and MLP projection at 10 times the full fine-tuning learning rate
(docs/lora.md); everything else is configs/qwen7b.py's. The mesh, rollout slots and KV
pool come from `python -m exgrpo_jax.aot plan` for the device.
"""

from configs import common
from configs import qwen7b


def get_config(arg=None):
  return common.lora_on_small_hardware(qwen7b.get_config(arg))
