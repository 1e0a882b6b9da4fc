r"""Evidence v3 (docs/results.md): the weak-model regime, pre-registered.

  python -m exgrpo_jax.train --config=configs/smollm2_study_v3.py:onpolicy \
      --config.train.seed=1 --workdir=runs/study_v3/onpolicy_s1

The embedded SmolLM2-135M-Instruct on sums and differences of numbers up to 40, where at
temperature 1 it solves about 8% of its rollouts and 70% of its groups of K = 8 are all
wrong (zero advantage under GRPO): the regime where the paper says replaying rare
successes matters most. Everything else is configs/smollm2_study.py's, but: K = 8 at
T = 1.0, 4 questions a step, 80 training questions (the 200 held-out ones drawn first,
never trained on), delayed start 0 (the paper's weak-model setting), rho = 0.25, lr 1e-5,
40 steps. Held-out avg@2 at T = 0.6 and greedy accuracy on all 200 problems every 10
steps (step 0 in the on-policy run: the same weights and evaluation key for every arm of
a seed). The first 160 graded completions of each evaluation go to eval_samples.jsonl,
for reading the correct ones by hand.

The arms are variants: the default (ExGRPO at rho = 0.25), `onpolicy`, `noreplay`;
the study runner runs them with the protocol's seeds and stages (configs/study_v3.py:
`python -m exgrpo_jax.study run --config=configs/study_v3.py --out=runs/study_v3`).
"""

from configs import common
from configs import smollm2_study


def get_config(arg=None):
  variant = common.local_variant(arg)
  c = smollm2_study.get_config()
  c.data.arithmetic.operations = "add,sub"
  c.data.arithmetic.max_operand = 40
  c.data.arithmetic.train_size = 80
  c.data.arithmetic.eval_size = 200
  c.rollout.k = 8
  c.rollout.temperature = 1.0
  c.train.batch_questions = 4
  c.algo.delayed_start = 0.0
  c.algo.rho = 0.25
  c.optim.lr = 1e-5
  c.train.steps = 40
  c.train.checkpoint_every = 5
  c.eval.every = 10
  c.eval.n = 2
  c.eval.samples = 160
  return common.apply_variant(c, variant)
