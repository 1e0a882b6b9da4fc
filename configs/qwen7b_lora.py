r"""Qwen2.5-Math-7B with LoRA: the paper's run (configs/qwen7b.py) on one GPU, a v5e-8 or a v6e-8.

  python -m exgrpo_jax.train --config=configs/qwen7b_lora.py:h200x1 --workdir=runs/qwen7b_lora

`common.lora_on_small_hardware`: the base frozen in bfloat16, rank-16 adapters (alpha 16)
on every attention and MLP projection at 10 times the full fine-tuning learning rate
(docs/lora.md); everything else is configs/qwen7b.py's. The argument names the device
(DEVICE, or DEVICE,VARIANT with a variant of configs/common.py): its mesh, micro-batch,
rollout slots and KV pool are the planner's for it (PLANNED, from
docs/results/aot_qwen7b_lora_<device>.json; docs/aot.md, "LoRA on small hardware").
Without one they are left for `python -m exgrpo_jax.aot plan` on your device.
"""

from configs import common
from configs import qwen7b

PLANNED = {
    "h100x1": dict(mesh_shape=(1, 1), micro_batch_size=8, max_rows=384, kv_pages=11532),
    "h200x1": dict(mesh_shape=(1, 1), micro_batch_size=8, max_rows=640, kv_pages=28359),
    "v5e-8": dict(mesh_shape=(2, 4), micro_batch_size=8, max_rows=640, kv_pages=21214),
    "v6e-8": dict(mesh_shape=(2, 4), micro_batch_size=8, max_rows=1024, kv_pages=37046),
}


def get_config(arg=None):
  return common.lora_on_small_hardware(qwen7b.get_config, PLANNED, arg, name="qwen7b_lora")
