r"""Llama-3.1-8B base, paper Table 5 (500 steps, no delayed start).

  python -m exgrpo_jax.train --config=configs/llama8b.py --workdir=runs/llama8b

On-policy RLVR collapses on this base model, so replay is on from step 1 (the paper
disables the delayed-start criterion) and the prompt is the plain base-model template.
The model is `meta-llama/Llama-3.1-8B` on the Hugging Face hub, gated: accept its licence
there, log in, then `python -m exgrpo_jax.fetch --config=configs/llama8b.py`
(docs/data.md, "Models").
"""

from configs import common


def get_config(arg=None):
  return common.paper_config(arg, model_path="checkpoints/Llama-3.1-8B",
                             template="plain", steps=500, delayed_start=0.0,
                             plans="llama8b")
