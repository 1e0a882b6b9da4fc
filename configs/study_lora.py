r"""Does LoRA learn here (docs/lora.md): study v3's on-policy arm with rank-8 adapters,
paired by seed against study v3's full fine-tuning on-policy runs.

  mkdir -p runs/study_lora/summaries
  cp docs/results/study_v3_runs/onpolicy_s[1-4].json runs/study_lora/summaries/
  python -m exgrpo_jax.study run --config=configs/study_lora.py --out=runs/study_lora
  python -m exgrpo_jax.study run --config=configs/study_lora.py --out=runs/study_lora \
      --exploratory  # then the exploratory ExGRPO arm
  python -m exgrpo_jax.study report --config=configs/study_lora.py --out=runs/study_lora

The copied summaries are the full fine-tuning arm (their runs are study v3's, same
training config, seeds and evaluation); the runner then runs the LoRA arm alone. The
rank, alpha and learning rate were fixed before any run: rank 8 on all seven
projections, alpha 16, and 10 times the full fine-tuning learning rate (1e-4 against
1e-5), the starting point docs/lora.md gives. A check that LoRA learns on this model,
not a test of the paper.
"""

import ml_collections

from configs import study_v3

PROTOCOL = """\
Arms: `lora` (study v3's on-policy arm, Dr.GRPO, with rank-8 adapters on all seven
  projections, alpha 16, lr 1e-4) and `onpolicy` (study v3's committed full fine-tuning
  runs, lr 1e-5), seeds 1-4, one stage. The comparison is the paired AUC difference
  lora - onpolicy with its 95% CI; no health rule and no fallback (neither arm replays).
Exploratory, its settings fixed before its runs: `exgrpo_lora` (study v3's ExGRPO arm
  with the same adapters and lr), seeds 1-4 after the primary runs, paired against both
  primary arms and reported as exploratory."""


def get_config(arg=None):
  if arg not in (None, "smoke"):
    raise ValueError(f"configs/study_lora.py:{arg}: unknown variant; known: smoke")
  c = study_v3.get_config(arg)
  c.name = "study_lora"
  c.protocol = PROTOCOL
  lora = ("model.lora.rank=8", "model.lora.alpha=16.0", "optim.lr=1e-4")
  c.arms = (("lora", "onpolicy", lora), ("onpolicy", "onpolicy", ()),
            ("exgrpo_lora", "exgrpo", lora))
  c.primary = ("lora", "onpolicy")
  c.fallback = c.primary
  c.attribution = ()
  c.exploratory = ("exgrpo_lora",)  # with --exploratory
  c.stages = ((1, 2, 3, 4),) if arg is None else c.stages
  c.health.min_healthy = 0
  c.verdict.exgrpo = False  # the paired figures alone: no ExGRPO health check or verdict
  return c
