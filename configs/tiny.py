r"""A tiny random-weight model on generated arithmetic, for tests of the training loop.

  python -m exgrpo_jax.train --config=configs/tiny.py --workdir=/tmp/tiny

It uses SmolLM2's tokenizer (so real prompts and rewards) with a 2-layer, 64-wide
random decoder, on the embedded arithmetic task (no data files).

As it stands it never replays: random weights never answer the arithmetic, so no group
mixes solved and unsolved answers, nothing enters the buffer, and `algo.rho` changes
nothing (a sweep of it logs identical metrics). Its replay delayed start is 0, so with a
reward that gives mixed groups the buffer fills at step 1 and is replayed from step 2.
The tests' even-length reward (1 for a response of an even number of characters) does
that on this model, from the repository root (tests/train_phases_test.py and
tests/kill_resume_test.py train so):

  python -m exgrpo_jax.train --config=configs/tiny.py --workdir=/tmp/tiny \
      --config.reward.plugins=tests.reward_plugins --config.reward.name=test_even_length

Replay on a real model with the real reward: configs/smollm2_135m.py (SmolLM2-135M-
Instruct solves about 30% of its arithmetic, so its buffer fills in the first steps).
"""

from configs import common


def get_config(arg=None):
  variant = common.local_variant(arg)
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
