r"""A tiny random-weight model on generated arithmetic, for tests of the training loop.

  python -m exgrpo_jax.train --config=configs/tiny.py --workdir=/tmp/tiny

It uses SmolLM2's tokenizer (so real prompts and rewards) with a 2-layer, 64-wide
random decoder, on the embedded arithmetic task (no data files); the replay delayed
start is 0, so the buffer is used from step 1.
"""

from configs import common


def get_config(arg=None):
  variant = common.local_variant(arg, "configs/tiny.py")
  c = common.base_config()
  c.model.random_init = True
  c.model.dtype = "float32"
  c.model.param_dtype = "float32"
  c.model.remat = "none"
  c.data.source = "arithmetic"
  c.data.limit = 64
  c.data.max_prompt_tokens = 192
  c.rollout.k = 4
  c.rollout.max_new_tokens = 16
  c.reward.num_workers = 1
  c.algo.delayed_start = 0.0
  c.optim.lr = 1e-4
  c.optim.micro_batch_size = 4
  c.train.steps = 3
  c.train.batch_questions = 4
  c.train.checkpoint_every = 2
  c.train.logprob_chunk = 8
  c.eval.every = 0
  c.eval.max_new_tokens = 16
  return common.apply_variant(c, variant)
