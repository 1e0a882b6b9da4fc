"""A run by wall time (exgrpo_jax/training/budget.py): the plan's step estimate, what a
budget buys, its console lines, the day recipe, and real runs of configs/tiny.py that
checkpoint and export by wall time and stop at their budget.

Times are given to `RunClock` (no clock is read) or made tiny, so every assertion is
on what was computed, written or printed, never on how long anything took.
"""

import collections
import json
import os

import pytest

from configs import common
from configs import qwen7b
from configs import qwen7b_lora
from exgrpo_jax import checkpointing
from exgrpo_jax.aot import plan_step
from exgrpo_jax.data import sources
from exgrpo_jax.models import export
from exgrpo_jax.training import budget
from exgrpo_jax.training import config_check
from exgrpo_jax.training import trainer as trainer_lib
from tests import trainer_test

HOUR = 3600.0


def test_the_plans_mid_step_is_docs_aot_figure():
  """docs/aot.md's "admitting, step s" at mid lengths: 685 s on one H100, 551 s on one
  H200 and 1987 s at the H200's measured efficiency."""
  rows = 128 * 8
  h100 = plan_step.mid_step(plan_step.read_plan(os.path.join(
      common.PLANS, "aot_qwen7b_lora_h100x1.json")), rows, 0.1)
  h200 = plan_step.mid_step(plan_step.read_plan(os.path.join(
      common.PLANS, "aot_qwen7b_lora_h200x1.json")), rows, 0.1)
  assert round(h100["floor_s"]) == 685 and h100["measured_s"] is None
  assert round(h200["floor_s"]) == 551 and round(h200["measured_s"]) == 1987
  assert h100["rollout_s"] < h100["floor_s"]


def test_the_day_recipe_budgets_from_the_devices_plan_and_bounds_evaluation():
  config = qwen7b_lora.get_config("h100x1,day")
  assert config.train.budget_hours == common.DAY_HOURS
  assert config.train.budget_plan == os.path.join(common.PLANS, "aot_qwen7b_lora_h100x1.json")
  assert config.train.checkpoint_every_minutes == config.train.export_every_minutes == 60
  assert config.train.checkpoint_every == 50  # the step cadence stays
  assert (config.eval.limit, config.eval.subset, config.eval.every) == (512, "spread", 5)
  rows = config.train.batch_questions * config.rollout.k
  assert config.eval.limit / (config.eval.every * rows) <= common.DAY_EVAL_SHARE
  # A variant and the day together; the 8-GPU config budgets from its own plan.
  onpolicy = qwen7b_lora.get_config("h200x1,onpolicy,day")
  assert onpolicy.algo.rho == 0 and onpolicy.train.budget_plan.endswith("_h200x1.json")
  assert qwen7b.get_config("day").train.budget_plan.endswith("aot_qwen7b_h100x8.json")
  assert qwen7b_lora.get_config("day").train.budget_plan == ""  # no device, no plan
  assert qwen7b_lora.get_config("h100x1").train.budget_hours == 0
  with pytest.raises(ValueError, match=r"config argument 'day': give one variant; unknown: day"):
    trainer_test.tiny.get_config("day")


def test_what_the_budget_buys_from_the_plans_estimate():
  config = qwen7b_lora.get_config("h100x1,day")
  estimate, note = plan_step.plan_estimate(config)
  assert round(estimate["step_s"]) == 685
  assert note.startswith("docs/results/aot_qwen7b_lora_h100x1.json: the plan's step")
  first, second = budget.RunClock(config, 0.0, estimate, note).start_lines(0, 512, 0.0)
  # 22 h over a step and a fifth of an evaluation (512 rows at the rollout's pace).
  each_eval = estimate["rollout_s"] * 512 / 1024
  steps = int(22 * HOUR // (estimate["step_s"] + each_eval / 5))
  assert steps == 110
  assert first == (f"budget 22 h: about {steps} of the remaining 700 steps at 685 s a step "
                   f"({note})")
  assert second.startswith(f"budget 22 h: about {-(-steps // 5)} evaluations on 512 problems "
                           f"(every 5 steps, about {each_eval:.0f} s each), about ")
  assert "checkpoints (every 50 steps or 60 min)" in second
  assert "exports to hf (every 60 min and at the end)" in second
  # At the H200's measured efficiency, fewer.
  h200 = qwen7b_lora.get_config("h200x1,day")
  estimate, note = plan_step.plan_estimate(h200)
  assert round(estimate["step_s"]) == 1987 and "NVIDIA H200's measured efficiency" in note


def test_a_budget_without_a_plan_or_with_one_for_other_lengths_counts_measured_steps():
  config = qwen7b.get_config("runlocal,day")  # 512 new tokens; the plan's are 8,192
  estimate, note = plan_step.plan_estimate(config)
  assert estimate is None and "was planned for responses of up to 8192 tokens" in note
  config.train.budget_plan = ""
  estimate, note = plan_step.plan_estimate(config)
  first, _ = budget.RunClock(config, 0.0, estimate, note).start_lines(0, 64, 0.0)
  assert first.startswith("budget 22 h: no step estimate (train.budget_plan")
  assert first.endswith("counted from measured steps as the run goes")


def _clock(hours=1.0, steps=100, **train):
  config = trainer_test.tiny.get_config()
  config.train.budget_hours, config.train.steps = hours, steps
  for key, value in train.items():
    config.train[key] = value
  return budget.RunClock(config, start=1000.0)


def test_measured_steps_correct_the_budget_and_end_it():
  clock = _clock(hours=1.0, steps=100)
  clock.stepped(300.0, now=1400.0)   # the first step compiles: 300 s
  assert clock.step_s() == 300
  clock.stepped(100.0, now=1500.0)
  clock.stepped(120.0, now=1620.0)
  assert clock.step_s() == 110       # the median after the first
  clock.checkpoint.done(1620.0, 30.0)
  clock.export.done(1620.0, 50.0)
  line = clock.progress_line(3, now=1620.0)
  # 620 s spent; a step with its share of the rest is (1620 - 1400) / 2 = 110 s; the end
  # takes 80 s: (3600 - 620 - 80) // 110 = 26 more steps.
  assert line.startswith("budget: step 3 at 0:10:20 of 1:00:00, 110 s a step measured "
                         "(110 s with evaluations, checkpoints and exports); the rest "
                         "holds about 26 more steps: the run stops near step 29, in 0:49:00")
  assert clock.room_for_another(now=1000.0 + 3600 - 190, evaluating=False)
  assert not clock.room_for_another(now=1000.0 + 3600 - 189, evaluating=False)
  assert clock.stop_line(3, now=4500.0).startswith(
      "budget: stopping after step 3, 0:58:20 of 1:00:00 spent: another step (110 s) with "
      "the end's evaluation, checkpoint and export (80 s) would pass it")
  # Near the end of train.steps the rest holds the remaining steps.
  assert "holds the remaining 5 steps: the run stops near step 100" in clock.progress_line(
      95, now=1620.0)


def test_no_budget_always_has_room_and_minutes_are_due_from_the_start_and_each_one():
  clock = _clock(hours=0.0, checkpoint_every_minutes=0.5, export_every_minutes=0.0)
  clock.stepped(5.0, now=1005.0)
  assert clock.room_for_another(now=1e9, evaluating=True)
  assert not clock.checkpoint.due(1029.0) and clock.checkpoint.due(1030.0)
  clock.checkpoint.done(1031.0, 1.0)
  assert not clock.checkpoint.due(1060.0) and clock.checkpoint.due(1061.0)
  assert not clock.export.due(1e9)  # 0: off


def test_spread_keeps_each_benchmarks_share(tmp_path):
  rows = [dict(data_source=src, prompt=[dict(role="user", content=f"{src} {i}")],
               reward_model=dict(ground_truth=str(i)))
          for src, n in (("aime", 24), ("math", 50), ("amc", 26)) for i in range(n)]
  path = tmp_path / "valid.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  config = trainer_test.tiny.get_config()
  config.eval.source, config.eval.path, config.eval.limit = "file", str(path), 20
  first = collections.Counter(q.data_source for q in sources.load(config, "eval").questions)
  assert first == {"aime": 20}
  config.eval.subset = "spread"
  spread = sources.load(config, "eval").questions
  assert collections.Counter(q.data_source for q in spread) == {"aime": 5, "math": 10,
                                                                  "amc": 5}
  assert spread == sources.load(config, "eval").questions  # a fixed subset


def test_spread_over_exgrpo_valid(shared_data_dir):
  config = qwen7b_lora.get_config("h100x1,day")
  config.data.dir = shared_data_dir
  questions = sources.load(config, "eval").questions
  counts = collections.Counter(q.data_source for q in questions)
  assert len(questions) == 512
  # 2,259 problems in six benchmarks: each keeps its share of the 512, give or take one.
  whole = {"aime": 240, "math": 500, "olympiad_bench": 675, "amc": 332, "minerva": 272,
           "aime25": 240}
  for source, n in whole.items():
    assert abs(counts[source] - n * 512 / 2259) <= 1, (source, counts)


@pytest.mark.parametrize("overrides, message", [
    ({"train.checkpoint_every_minutes": -1.0}, "config.train.checkpoint_every_minutes=-1.0"),
    ({"train.export_every_minutes": 5.0, "train.export_dir": ""},
     "config.train.export_every_minutes=5.0: needs train.export_dir"),
    ({"train.budget_plan": "plan.json"}, "config.train.budget_plan='plan.json': is read "
                                         "only with train.budget_hours above 0"),
    ({"train.budget_hours": 1.0, "train.budget_plan": "/no/plan.json"},
     "config.train.budget_plan='/no/plan.json': no such file"),
    ({"eval.source": "arithmetic", "eval.subset": "random", "eval.every": 1,
      "eval.limit": 4},
     "config.eval.subset='random': must be one of first, spread"),
])
def test_bad_budget_settings_are_one_line(overrides, message):
  config = trainer_test.tiny.get_config()
  for key, value in overrides.items():
    section, name = key.split(".")
    config[section][name] = value
  with pytest.raises(config_check.ConfigError) as e:
    config_check.check(config)
  assert len(str(e.value).splitlines()) == 1 and str(e.value).startswith(message)


@pytest.mark.parametrize("content, problem", [
    ("{", "not a JSON file"), ("{}", "not a plan that fits"),
    (json.dumps(dict(fits=False, verdict="does not fit")), "not a plan that fits")])
def test_a_budget_plan_that_is_not_a_plan_is_one_line(tmp_path, content, problem):
  path = tmp_path / "plan.json"
  path.write_text(content)
  config = trainer_test.tiny.get_config()
  config.train.budget_hours, config.train.budget_plan = 1.0, str(path)
  config_check.check(config)  # the file is there
  with pytest.raises(config_check.ConfigError, match=(
      rf"^config.train.budget_plan='{path}': {problem}")):
    trainer_lib.Trainer(config, str(tmp_path / "run"), estimate=plan_step.plan_estimate)
  assert not os.path.exists(tmp_path / "run")  # refused before anything is written


def _tiny_run(workdir, capsys, **train):
  config = trainer_test.tiny.get_config()
  config.reward.plugins = "tests.reward_plugins"
  config.reward.name = "test_even_length"
  config.train.checkpoint_every = 100  # never by steps, but at the end
  config.train.keep_checkpoints = 5
  for key, value in train.items():
    config.train[key] = value
  trainer = trainer_lib.Trainer(config, str(workdir))
  trainer.run()
  out = capsys.readouterr()
  return trainer, out.out + out.err


def _checkpoints(workdir) -> list[int]:
  return [int(os.path.basename(d)) for d in checkpointing.step_dirs(str(workdir))]


def _export_step(workdir) -> int:
  with open(os.path.join(workdir, "hf", export.EXPORT_INFO), encoding="utf-8") as f:
    return json.load(f)["step"]


def test_checkpoints_and_exports_by_wall_time_then_the_budget_stops_usable(tmp_path, capsys):
  # Minutes this small are due after every step.
  trainer, out = _tiny_run(tmp_path, capsys, steps=2, checkpoint_every_minutes=1e-9,
                           export_every_minutes=1e-9)
  assert _checkpoints(tmp_path) == [2, 1]
  assert "exported step 1 to" in out and "exported step 2 to" in out
  assert _export_step(tmp_path) == 2 and not trainer.preempted

  # A budget spent at the start: the process's first step still runs (nothing is
  # measured before it), then the run stops with that step checkpointed and exported.
  trainer, out = _tiny_run(tmp_path, capsys, steps=10, budget_hours=1e-9)
  assert trainer.state.step == 3 and not trainer.preempted
  assert _checkpoints(tmp_path) == [3, 2, 1]
  assert _export_step(tmp_path) == 3
  assert ("budget 1e-09 h: no step estimate (train.budget_plan, a plan of `python -m "
          "exgrpo_jax.aot plan` for this config and device, is empty)") in out
  assert "budget: stopping after step 3, " in out
  assert "they follow for this step, then the run ends" in out
  assert "exported step 3 to" in out
