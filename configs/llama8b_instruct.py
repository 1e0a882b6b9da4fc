r"""Llama-3.1-8B-Instruct, paper Table 5 (500 steps).

  python -m exgrpo_jax.train --config=configs/llama8b_instruct.py --workdir=runs/llama8b_instruct

The qwen7b recipe on the instruct model, `meta-llama/Llama-3.1-8B-Instruct` on the Hugging
Face hub (`python -m exgrpo_jax.fetch --config=configs/llama8b_instruct.py`; docs/data.md,
"Models").
"""

from configs import common


def get_config(arg=None):
  return common.paper_config(arg, model_path="checkpoints/Llama-3.1-8B-Instruct",
                             template="exgrpo_think", steps=500, delayed_start=0.35,
                             plans="llama8b")
