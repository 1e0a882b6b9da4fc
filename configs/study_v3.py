r"""Evidence v3's protocol (docs/results.md), the pre-registered weak-model study, as a
study config for the study runner.

  python -m exgrpo_jax.study run --config=configs/study_v3.py --out=runs/study_v3
  python -m exgrpo_jax.study run --config=configs/study_v3.py --out=/tmp/study --smoke

Every run trains configs/smollm2_study_v3.py (`train_config`) with its arm's variant and
overrides and the seed. `protocol` is the rules in words, copied into the report; the
fields below it are the same rules as the runner applies them (exgrpo_jax/study).
`get_config("smoke")` (the runner's `--smoke`) is the same protocol shrunk to a pipeline
check of about a minute: configs/tiny.py, one seed of the primary pair, 2 steps,
evaluated at steps 0, 1 and 2 on 2 problems; its figures mean nothing.
"""

import ml_collections

PROTOCOL = """\
Arms: `onpolicy` (Dr.GRPO) and `exgrpo` (rho 0.25) on every seed; on seeds 1-4 also
  `noreplay` (ExGRPO at rho 0: the mixed phase's unclipped fresh tokens and retirement,
  no replay) and `delayed` (ExGRPO with the paper's delayed start, batch accuracy
  > 0.35, clipped until then). `rho50` (the paper's share) on seeds 1-4 only with
  --exploratory, after everything else, reported as exploratory.
  Stage 1: seeds 1-4. If the SD of the paired AUC differences (exgrpo - onpolicy) is
  above 12 points, stop: not resolvable at this budget. Else stage 2: seeds 5-8.
  Health: an ExGRPO run passes with >= 5 buffered questions at step 10 and a mean of
  replayed / buffered questions <= 0.2 over steps 11-40. Unless 6 of the 8 pass, both
  arms are rerun at rho 0.125 with 8 questions a step (`onpolicy_b8`, `exgrpo_b8`), by
  the same stages."""


def get_config(arg=None):
  if arg not in (None, "smoke"):
    raise ValueError(f"configs/study_v3.py:{arg}: unknown variant; known: smoke")
  c = ml_collections.ConfigDict()
  c.name = "study_v3"  # the report's file names: <name>.json, <name>_*.png
  c.protocol = PROTOCOL
  c.train_config = "configs/smollm2_study_v3.py"  # relative to the repository root
  c.run_overrides = ()  # `key=value` config overrides of every run
  # The arms, in the report's order: name, the train config's variant, own overrides.
  c.arms = (
      ("onpolicy", "onpolicy", ()),
      ("exgrpo", "exgrpo", ()),
      ("noreplay", "noreplay", ()),
      ("delayed", "exgrpo", ("algo.delayed_start=0.35",)),
      ("rho50", "exgrpo", ("algo.rho=0.5",)),
      ("onpolicy_b8", "onpolicy", ("train.batch_questions=8",)),
      ("exgrpo_b8", "exgrpo", ("algo.rho=0.125", "train.batch_questions=8")),
  )
  c.primary = ("exgrpo", "onpolicy")         # the verdict's pair: AUC(first) - AUC(second)
  c.fallback = ("exgrpo_b8", "onpolicy_b8")  # replaces it when replay is unhealthy
  c.attribution = ("noreplay", "delayed")    # stage 1's seeds only
  c.exploratory = ("rho50",)                 # with --exploratory, after everything else
  c.stages = ((1, 2, 3, 4), (5, 6, 7, 8))    # seeds
  c.eval_steps = (10, 20, 30, 40)  # the AUC: mean held-out avg@2 over these steps
  c.max_sd = 0.12  # stop after stage 1 above this SD of the paired AUC differences
  c.retries = 2    # a crashed run is resumed this many times before the runner stops
  c.health = ml_collections.ConfigDict(dict(
      step=10,               # buffered questions counted at this step
      min_buffered=5,
      max_replay_share=0.2,  # mean replayed / buffered over the steps after `step`
      min_healthy=6,         # ExGRPO runs of all the stages' seeds, else the fallback
  ))
  c.verdict = ml_collections.ConfigDict(dict(
      support_pairs=6,     # of 8: ExGRPO's zero-advantage share below on-policy's
      rescue=0.09,         # "no rescue-sized effect" when the upper 95% bound is below
      manipulation=0.03,   # some arm's AUC gain over step 0
      collapse=0.05,       # greedy accuracy lost from step 0 to the last step
      exgrpo=True,         # False: a study of no ExGRPO claim; its report has no rules
  ))
  if arg == "smoke":
    c.train_config = "configs/tiny.py"
    c.run_overrides = ("train.steps=2", "train.export_dir=", "eval.source=arithmetic",
                       "eval.before_train=False",
                       "eval.every=1", "eval.limit=2", "eval.n=2", "eval.greedy=True",
                       "eval.samples=4")
    c.attribution = ()
    c.stages = ((1,),)
    c.eval_steps = (1, 2)
    c.health.step = 1
    c.health.min_healthy = 0
  return c
