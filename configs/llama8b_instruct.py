r"""Llama-3.1-8B-Instruct, paper Table 5 (500 steps).

  python -m exgrpo_jax.train --config=configs/llama8b_instruct.py --workdir=runs/llama8b_instruct

The qwen7b recipe on the instruct model.
"""

from configs import common


def get_config(arg=None):
  return common.paper_config(arg, model_path="checkpoints/Llama-3.1-8B-Instruct",
                             template="exgrpo_think", steps=500, delayed_start=0.35,
                             mesh_shape=(-1, 8), max_rows=1024,
                             kv_pages=60320,  # the planner, h100x8 (docs/aot.md)
                             plan="aot_llama8b_h100x8.json")  # the same shapes
