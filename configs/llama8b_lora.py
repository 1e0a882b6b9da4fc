r"""Llama-3.1-8B with LoRA: the paper's run (configs/llama8b.py) on one GPU, a v5e-8 or a v6e-8.

  python -m exgrpo_jax.prepare_data  # the paper's data (docs/data.md)
  python -m exgrpo_jax.fetch --config=configs/llama8b_lora.py  # the model (or --config.model.path=)
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m exgrpo_jax.train \
      --config=configs/llama8b_lora.py:h200x1 --workdir=runs/llama8b_lora

As configs/qwen7b_lora.py (its docstring says what the argument takes), for
configs/llama8b.py, with the plans docs/results/aot_llama8b_lora_<DEVICE>.json.
"""

from configs import common
from configs import llama8b

def get_config(arg=None):
  return common.lora_on_small_hardware(llama8b.get_config, "llama8b_lora", arg)
