r"""Llama-3.1-8B base, paper Table 5 (500 steps, no delayed start).

  python -m exgrpo_jax.train --config=configs/llama8b.py --workdir=runs/llama8b

On-policy RLVR collapses on this base model, so replay is on from step 1 (the paper
disables the delayed-start criterion) and the prompt is the plain base-model template.
"""

from configs import common


def get_config(arg=None):
  return common.paper_config(arg, model_path="checkpoints/Llama-3.1-8B",
                             template="plain", steps=500, delayed_start=0.0,
                             mesh_shape=(-1, 8), max_rows=1024,
                             kv_pages=60320,  # the planner, h100x8 (docs/aot.md)
                             plan="aot_llama8b_h100x8.json")
