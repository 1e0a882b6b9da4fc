r"""Qwen2.5-Math-7B with the paper's hyper-parameters on 8 GPUs (Table 1).

  python -m exgrpo_jax.train --config=configs/qwen7b.py --workdir=runs/qwen7b

B=128 questions, K=8, responses up to 8192 tokens, rho=0.5, lr 1e-6, delayed start at
batch accuracy 0.35, 700 steps. The authors trained LUFFY's 16k-context variant of the
model (rope_theta 40000); point model.path at a local copy.
"""

from configs import common


def get_config(arg=None):
  return common.paper_config(arg, model_path="checkpoints/Qwen2.5-Math-7B-16k-think",
                             template="exgrpo_think", steps=700, delayed_start=0.35,
                             mesh_shape=(-1, 4), max_rows=1024,
                             kv_pages=137800,  # the planner, h100x8 (docs/aot.md)
                             plan="aot_qwen7b_h100x8.json")
