r"""Qwen2.5-7B-Instruct, paper Table 5 (500 steps).

  python -m exgrpo_jax.train --config=configs/qwen7b_instruct.py --workdir=runs/qwen7b_instruct

The qwen7b recipe on the instruct model, `Qwen/Qwen2.5-7B-Instruct` on the Hugging
Face hub (`python -m exgrpo_jax.fetch --config=configs/qwen7b_instruct.py`; docs/data.md,
"Models").
"""

from configs import common


def get_config(arg=None):
  return common.paper_config(arg, model_path="checkpoints/Qwen2.5-7B-Instruct",
                             template="exgrpo_think", steps=500, delayed_start=0.35,
                             plans="qwen7b")
