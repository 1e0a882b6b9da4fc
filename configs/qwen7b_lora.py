r"""Qwen2.5-Math-7B with LoRA: the paper's run (configs/qwen7b.py) on one GPU, a v5e-8 or a v6e-8.

  python -m exgrpo_jax.prepare_data  # the paper's data (docs/data.md)
  python -m exgrpo_jax.fetch --config=configs/qwen7b_lora.py  # the model (or --config.model.path=)
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m exgrpo_jax.train \
      --config=configs/qwen7b_lora.py:h200x1 --workdir=runs/qwen7b_lora

`common.lora_on_small_hardware`: the base frozen in bfloat16, rank-16 adapters (alpha 16)
on every attention and MLP projection at 30 times the full fine-tuning learning rate
(docs/lora.md, "The recipe"); everything else is configs/qwen7b.py's. The argument names
the device (any target of `python -m exgrpo_jax.aot`; DEVICE,VARIANT with a variant of
configs/common.py): its mesh, micro-batch, rollout slots and KV pool are those of its
plan, docs/results/aot_qwen7b_lora_<DEVICE>.json (docs/aot.md, "LoRA on small
hardware"); a device without one says how to make it. Without a device they are left
for `python -m exgrpo_jax.aot plan` on your device.
"""

from configs import common
from configs import qwen7b

def get_config(arg=None):
  return common.lora_on_small_hardware(qwen7b.get_config, "qwen7b_lora", arg)
