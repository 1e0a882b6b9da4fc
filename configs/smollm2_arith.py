r"""The small-scale study (docs/results.md): SmolLM2-135M-Instruct on generated arithmetic.

  python scripts/make_arithmetic.py --out runs/data/arith
  python -m exgrpo_jax.train --config=configs/smollm2_arith.py:onpolicy \
      --config.train.seed=1 --workdir=runs/study/onpolicy_s1

Greedy base accuracy is about 10% (docs/results.md), so groups of K=4 are often mixed
and the buffer fills. The delayed start is off (as the paper does for Llama): at this
accuracy the batch never clears the 35% threshold. The learning rate is 20x the 7B
recipe's because the model is 50x smaller and the run is ~100x shorter; everything else
keeps the paper's defaults (rho=0.5, gamma=0.1, lowest-entropy selection, Gaussian
bucket weights, Dr.GRPO advantages, no clipping in the mixed phase).
"""

import os

from configs import common
from configs import smollm2_135m

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "runs", "data", "arith")


def get_config(arg=None):
  variant, _ = common.parse_arg(arg)
  c = smollm2_135m.get_config()  # the embedded model, float32, one reward worker
  c.data.train_path = os.path.normpath(os.path.join(DATA, "train.jsonl"))
  c.data.max_prompt_tokens = 128
  c.rollout.max_new_tokens = 64
  c.algo.delayed_start = 0.0
  c.optim.lr = 2e-5
  c.train.steps = 12
  c.train.checkpoint_every = 3
  c.eval.path = os.path.normpath(os.path.join(DATA, "test.jsonl"))
  c.eval.every = 6
  c.eval.limit = 100  # rows alternate between the 4 operations: 25 of each
  c.eval.max_new_tokens = 64
  return common.apply_variant(c, variant)
