r"""Llama-3.1-8B with LoRA: the paper's run (configs/llama8b.py) on one GPU, a v5e-8 or a v6e-8.

  python -m exgrpo_jax.train --config=configs/llama8b_lora.py:h200x1 --workdir=runs/llama8b_lora

As configs/qwen7b_lora.py (its docstring says what the argument and PLANNED are), for
configs/llama8b.py; PLANNED from docs/results/aot_llama8b_lora_<device>.json.
"""

from configs import common
from configs import llama8b

PLANNED = {
    "h100x1": dict(mesh_shape=(1, 1), micro_batch_size=8, max_rows=64, kv_pages=4584),
    "h200x1": dict(mesh_shape=(1, 1), micro_batch_size=8, max_rows=320, kv_pages=11948),
    "v5e-8": dict(mesh_shape=(1, 8), micro_batch_size=4, max_rows=320, kv_pages=9692),
    "v6e-8": dict(mesh_shape=(1, 8), micro_batch_size=2, max_rows=384, kv_pages=16155),
}


def get_config(arg=None):
  return common.lora_on_small_hardware(llama8b.get_config, PLANNED, arg, name="llama8b_lora")
