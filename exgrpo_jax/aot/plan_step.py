"""A plan's training step as a run on a budget starts from (`train.budget_plan`;
exgrpo_jax/training/budget.py): the plan read and its mid-length step priced, at the
run's own responses a step and, where the device has been measured, at its efficiency.

  estimate, note = plan_step.plan_estimate(config)   # handed to the trainer by
                                                     # `python -m exgrpo_jax.train`
"""

import json
import os

from exgrpo_jax.aot import lengths
from exgrpo_jax.aot import step_lengths
from exgrpo_jax.training import budget
from exgrpo_jax.training import config_check


def read_plan(path: str) -> dict:
  """A plan JSON of `exgrpo_jax.aot plan` that fits; a ConfigError naming
  `train.budget_plan` and what is wrong otherwise."""
  problem = None
  try:
    with open(path, encoding="utf-8") as f:
      plan = json.load(f)
  except OSError as e:
    problem = e.strerror
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    problem = f"not a JSON file ({e})"
  else:
    if not isinstance(plan, dict) or not plan.get("fits") or "report" not in plan:
      problem = ("not a plan that fits (a JSON object of `python -m exgrpo_jax.aot plan` "
                 "whose verdict is 'fits')")
  if problem:
    raise config_check.ConfigError(f"config.train.budget_plan={path!r}: {problem}")
  return plan


def mid_step(plan: dict, rows: int, headroom: float) -> dict:
  """The plan's training step at the mid response lengths (`aot.lengths.SCENARIOS`) over
  `rows` responses: `floor_s`, the roofline seconds of the rollout with admission, the
  old-log-prob recompute and the learner (`plan --render --estimate`'s "admitting, step
  s", `step_lengths.plan_step`), its `rollout_s`, and `measured_s` and
  `measured_rollout_s` at the device's measured efficiency (`aot.step_lengths.MEASURED`;
  None without one)."""
  report = plan["report"]
  mid = lengths.scenario("mid", report["batch"]["response_tokens"], rows)
  step = step_lengths.plan_step(plan, mid, headroom)
  rollout, trained = step["rollout_s"], step["recompute_s"] + step["learner_s"]
  device = report["target"].get("device_kind")
  measured = step_lengths.MEASURED.get(device)
  return dict(floor_s=rollout + trained, rollout_s=rollout, device=device,
              measured_s=step_lengths.at_measured(report["target"], rollout, trained),
              measured_rollout_s=measured and rollout / measured["decode"])


def plan_estimate(config) -> tuple[dict | None, str]:
  """(estimate, note): `step_s` and `rollout_s` of `train.budget_plan`'s mid step at this
  run's responses a step, at the measured efficiency where the device has one, else the
  roofline's; None where there is no plan or it was made for other response lengths
  (the note then says why)."""
  path = config.train.budget_plan
  if not path:
    return budget.unplanned(config)
  plan, shown = read_plan(path), os.path.relpath(path)
  shown = path if shown.startswith(os.pardir) else shown
  planned = plan["report"]["batch"]["response_tokens"]
  if planned != config.rollout.max_new_tokens:
    return None, (f"no step estimate ({shown} was planned for responses of up to "
                  f"{planned} tokens, this run's are {config.rollout.max_new_tokens})")
  rows = config.train.batch_questions * config.rollout.k
  step = mid_step(plan, rows, config.rollout.kv_headroom)
  what = f"{shown}: the plan's step at mid response lengths"
  if step["measured_s"] is None:
    return (dict(step_s=step["floor_s"], rollout_s=step["rollout_s"]),
            f"{what}, a roofline lower bound")
  return (dict(step_s=step["measured_s"], rollout_s=step["measured_rollout_s"]),
          f"{what} at the {step['device']}'s measured efficiency; {step['floor_s']:.0f} s "
          "at the roofline's lower bound")
