r"""The small-scale study (docs/results.md): the embedded default, trained longer and
evaluated two ways.

  python -m exgrpo_jax.train --config=configs/smollm2_study.py:onpolicy \
      --config.train.seed=1 --workdir=runs/study/onpolicy_s1

Model, task and hyper-parameters are configs/smollm2_135m.py's: SmolLM2-135M-Instruct on
the generated arithmetic (sums and differences up to 15), where it starts at about 30%
of its rollouts solved at temperature 0.7 (50% greedy), so groups of K = 4 mix solved and
unsolved answers and the replay buffer fills. B = 4 questions a step, the paper's rho,
gamma, lowest-entropy selection, Gaussian bucket weights and Dr.GRPO advantages.

Each evaluation scores all 60 held-out problems greedily (val/greedy_score) and by avg@4
at temperature 0.6 (val/avg_score). The step count is what lets 16 runs (5 seeds of
on-policy and of ExGRPO, 3 of each ablation) fit in about two hours on 2 CPU cores
(docs/results.md, "Reproduce"). No HF export and one checkpoint kept: 16 workdirs.
"""

from configs import common
from configs import smollm2_135m


def get_config(arg=None):
  variant = common.local_variant(arg)
  c = smollm2_135m.get_config()
  c.train.steps = 16
  c.train.checkpoint_every = 4
  c.train.keep_checkpoints = 1
  c.train.export_dir = ""
  # The step-0 evaluation is the same for every method of a seed (same weights, same
  # key): the on-policy run of a seed asks for it (--config.eval.before_train=True).
  c.eval.before_train = False
  c.eval.every = 8
  c.eval.limit = 0  # the whole held-out split (data.arithmetic.eval_size = 60)
  c.eval.temperature = 0.6
  c.eval.n = 4
  c.eval.greedy = True
  return common.apply_variant(c, variant)
