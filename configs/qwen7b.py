r"""Qwen2.5-Math-7B with the paper's hyper-parameters on 8 GPUs (Table 1).

  python -m exgrpo_jax.train --config=configs/qwen7b.py --workdir=runs/qwen7b

B=128 questions, K=8, responses up to 8192 tokens, rho=0.5, lr 1e-6, delayed start at
batch accuracy 0.35, 700 steps. The authors trained LUFFY's 16k-context variant of the
model, `Elliott/Qwen2.5-Math-7B-16k-think` on the Hugging Face hub (rope_theta 40000,
16,384 positions; the stock Qwen2.5-Math-7B has rope_theta 10000 and 4,096 positions, too
few for these responses, and is refused). Fetch it once (docs/data.md, "Models"):

  python -m exgrpo_jax.fetch --config=configs/qwen7b.py
"""

from configs import common


def get_config(arg=None):
  return common.paper_config(arg, model_path="checkpoints/Qwen2.5-Math-7B-16k-think",
                             template="exgrpo_think", steps=700, delayed_start=0.35,
                             plans="qwen7b")
