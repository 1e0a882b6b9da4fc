r"""Qwen2.5-Math-1.5B, paper Table 5 (500 steps).

  python -m exgrpo_jax.train --config=configs/qwen1_5b.py --workdir=runs/qwen1_5b \
      --config.rollout.max_new_tokens=3072 --config.eval.max_new_tokens=3072

The qwen7b recipe on the 1.5B base model, `Qwen/Qwen2.5-Math-1.5B` on the Hugging Face
hub (`python -m exgrpo_jax.fetch --config=configs/qwen1_5b.py`; docs/data.md, "Models").
It has 4,096 positions, too few for the recipe's 8,192-token responses beside 1,024-token
prompts: without the two flags above the run is refused. The paper's authors published
no longer-context copy of it.
"""

from configs import common


def get_config(arg=None):
  return common.paper_config(arg, model_path="checkpoints/Qwen2.5-Math-1.5B",
                             template="exgrpo_think", steps=500, delayed_start=0.35,
                             plans="qwen1_5b")
