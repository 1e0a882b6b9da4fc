r"""The LoRA recipe (docs/lora.md): the learning rate tuned on seeds 1-2, then the chosen
setting confirmed on held-out seeds 5-8 against study v3's full fine-tuning runs.

  mkdir -p runs/study_lora_recipe/summaries
  cp docs/results/study_v3_runs/onpolicy_s[125678].json runs/study_lora_recipe/summaries/
  python -m exgrpo_jax.study run --config=configs/study_lora_recipe.py \
      --out=runs/study_lora_recipe
  python -m exgrpo_jax.study run --config=configs/study_lora_recipe.py \
      --out=runs/study_lora_recipe --exploratory  # then rank 1 at the chosen setting
  python -m exgrpo_jax.study report --config=configs/study_lora_recipe.py \
      --out=runs/study_lora_recipe

The copied summaries are the full fine-tuning arm (study v3's on-policy runs: the same
training config, seeds and evaluation). Every rule below was fixed before any run.
"""

from configs import study_v3

PROTOCOL = """\
Tuning (seeds 1-2): study v3's on-policy arm (Dr.GRPO, 40 steps) with rank-8 adapters
  on all seven projections, alpha 16 (scale alpha / r = 2), at three learning rates:
  `lr1e-4` (the LoRA study's setting), `lr3e-4`, `lr1e-3`. The winner is the candidate
  of the highest mean AUC (held-out avg@2 over steps 10-40) over seeds 1 and 2; a
  candidate within 0.5 points of the best loses to the smaller learning rate, and a
  candidate with a collapsed run (greedy accuracy at step 40 five or more points below
  step 0) is never chosen. Alpha is not tuned: with alpha fixed the scale is alpha / r,
  the parametrisation under which the best learning rate is said to be nearly
  independent of the rank, so the learning rate is the one knob.
Confirmation (seeds 5-8, never used in tuning): `tuned`, the winner's setting, paired by
  seed against `onpolicy` (study v3's committed full fine-tuning runs, lr 1e-5). The
  result is the paired AUC difference tuned - onpolicy with its 95% CI and the paired
  differences at each evaluation step; "caught up" means the CI's lower bound above
  -3 points. No health rule and no stopping rule: neither arm replays.
Exploratory, with --exploratory after the confirmation: `tuned_r1`, the winner's
  learning rate and alpha at rank 1 (scale 16), seeds 5-8, paired against both."""


def get_config(arg=None):
  if arg not in (None, "smoke"):
    raise ValueError(f"configs/study_lora_recipe.py:{arg}: unknown variant; known: smoke")
  c = study_v3.get_config(arg)
  c.name = "study_lora_recipe"
  c.protocol = PROTOCOL
  lora = ("model.lora.rank=8", "model.lora.alpha=16.0")
  c.arms = (("lr1e-4", "onpolicy", (*lora, "optim.lr=1e-4")),
            ("lr3e-4", "onpolicy", (*lora, "optim.lr=3e-4")),
            ("lr1e-3", "onpolicy", (*lora, "optim.lr=1e-3")),
            ("tuned", "onpolicy", ("@tuned",)),
            ("onpolicy", "onpolicy", ()),
            ("tuned_r1", "onpolicy", ("@tuned", "model.lora.rank=1")))
  c.tuning = dict(arms=("lr1e-4", "lr3e-4", "lr1e-3"), seeds=(1, 2), tie=0.005)
  c.primary = ("tuned", "onpolicy")
  c.fallback = c.primary
  c.attribution = ()
  c.exploratory = ("tuned_r1",)  # with --exploratory
  c.stages = ((5, 6, 7, 8),)
  c.max_sd = 1.0  # no stopping rule
  c.health.min_healthy = 0
  c.verdict.exgrpo = False  # the paired figures alone: no ExGRPO health check or verdict
  if arg == "smoke":
    c.tuning.seeds = (1,)
    c.stages = ((2,),)
  return c
