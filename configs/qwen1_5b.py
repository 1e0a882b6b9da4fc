r"""Qwen2.5-Math-1.5B, paper Table 5 (500 steps).

  python -m exgrpo_jax.train --config=configs/qwen1_5b.py --workdir=runs/qwen1_5b

The qwen7b recipe on the 1.5B base model.
"""

from configs import common


def get_config(arg=None):
  return common.paper_config(arg, model_path="checkpoints/Qwen2.5-Math-1.5B",
                             template="exgrpo_think", steps=500, delayed_start=0.35,
                             mesh_shape=(-1, 1),  # the planner for h100x8: all rows
                             plan="aot_qwen1_5b_h100x8.json")
