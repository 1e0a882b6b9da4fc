"""Reward plugins: docs/rewards.md's worked example through `eval` (the embedded SmolLM2)
and through training's grader, in worker processes; a plugin that raises everywhere."""

import dataclasses
import importlib
import json
import os
import re
import sys

import numpy as np
import pytest

from exgrpo_jax import data
from exgrpo_jax import eval as eval_cli
from exgrpo_jax import rewards
from exgrpo_jax.training import grading
from exgrpo_jax.training import groups as groups_lib
from tests import conftest

DOC = os.path.join(conftest.REPO_ROOT, "docs", "rewards.md")


def _doc_plugin() -> str:
  """The code block of docs/rewards.md that starts `# my_rewards.py`."""
  with open(DOC, encoding="utf-8") as f:
    blocks = re.findall(r"```python\n(.*?)```", f.read(), re.DOTALL)
  [code] = [b for b in blocks if b.startswith("# my_rewards.py")]
  return code


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
  """A directory on sys.path holding the doc's `my_rewards.py` and a `raising_rewards.py`
  whose reward raises on every response. Their rewards are unregistered afterwards, so
  later pools do not look for these modules."""
  (tmp_path / "my_rewards.py").write_text(_doc_plugin())
  (tmp_path / "raising_rewards.py").write_text(
      "from exgrpo_jax import rewards\n\n\n"
      "@rewards.REWARDS.register('always_raises')\n"
      "def always_raises(solution, ground_truth):\n"
      "  raise ZeroDivisionError('plugin bug')\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  before = dict(rewards.REWARDS._table)  # pylint: disable=protected-access
  yield tmp_path
  rewards.REWARDS._table.clear()  # pylint: disable=protected-access
  rewards.REWARDS._table.update(before)  # pylint: disable=protected-access
  for name in ("my_rewards", "raising_rewards"):
    sys.modules.pop(name, None)


def _last_int_correct(response: str, ground_truth: str) -> bool:
  """The example's rule, counted here on its own: the last integer equals the answer."""
  numbers = re.findall(r"-?\d+", response)
  return bool(numbers) and int(numbers[-1]) == int(ground_truth)


def test_a_reward_registered_by_importing_its_module_is_known_to_the_workers(plugin_dir):
  importlib.import_module("my_rewards")  # by hand: no plugin_modules below
  items = [rewards.RewardItem(text, "12", "last_int") for text in ("3 + 9 = 12", "13", "?")]
  with rewards.RewardPool(num_workers=1) as pool:
    rewards_N, status_N, _ = pool.score_with_status(items)
  assert rewards_N.tolist() == [1.0, 0.0, 0.0]
  assert status_N.tolist() == ["ok", "ok", "no_answer"]


def test_eval_with_the_doc_plugin_reward_and_its_defaults(plugin_dir, tmp_path):
  out = tmp_path / "results.json"
  argv = ["--data", "arithmetic", "--limit", "10", "--reward-module", "my_rewards",
          "--reward", "last_int", "--save-responses", "--out", str(out)]
  assert eval_cli.main(argv) == 0
  results = json.loads(out.read_text())
  assert results["config"]["max_new_tokens"] == eval_cli.ARITHMETIC_MAX_NEW_TOKENS
  responses = results["responses"]
  assert len(responses) == 20 and {r["data_source"] for r in responses} == {"arith_add",
                                                                           "arith_sub"}
  correct = {}
  for r in responses:
    correct.setdefault(r["data_source"], []).append(
        _last_int_correct(r["response"], r["ground_truth"]))
    assert r["reward"] == float(correct[r["data_source"]][-1])
  for source, marks in correct.items():
    assert results["per_source"][source]["avg@k"] == pytest.approx(np.mean(marks))
    assert results["per_source"][source]["exceptions"] == 0
  mean = np.mean([np.mean(m) for m in correct.values()])
  assert 0 < mean < 1  # some right, some wrong: the comparison means something
  assert results["rewards"] == {"last_int": dict(samples=20, exceptions=0,
                                                 first_exception="")}


def test_eval_exits_nonzero_with_one_line_when_a_plugin_raises_everywhere(plugin_dir,
                                                                           capsys):
  argv = ["--data", "arithmetic", "--limit", "2", "--max-new-tokens", "4",
          "--reward-module", "raising_rewards", "--reward", "always_raises"]
  assert eval_cli.main(argv) == 1
  captured = capsys.readouterr()
  errors = [l for l in captured.err.splitlines() if l.startswith("error:")]
  assert errors == ["error: reward 'always_raises' raised on all 4 samples (first: "
                    "ZeroDivisionError: plugin bug): nothing was scored"]
  assert "Traceback" not in captured.err and "plugin bug" not in captured.err.replace(
      errors[0], "")
  [row] = [l for l in captured.out.splitlines() if l.startswith("arith_add")]
  assert row.split()[-1] == "2"  # the table's exception count


def test_an_unknown_reward_or_module_is_one_line(plugin_dir, capsys):
  assert eval_cli.main(["--data", "arithmetic", "--reward", "last_int"]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: --reward 'last_int' is not a "
                                             "registered reward; known: "), err
  assert eval_cli.main(["--data", "arithmetic", "--reward-module", "no_such_rewards"]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["error: reward plugin module 'no_such_rewards' cannot be imported: No "
                 "module named 'no_such_rewards'"]


def test_training_grades_with_the_doc_plugin_in_worker_processes(plugin_dir):
  config = importlib.import_module("configs.tiny").get_config()
  config.reward.plugins, config.reward.name, config.reward.num_workers = (
      "my_rewards", "last_int", 2)
  questions = data.arithmetic.make_questions(data.arithmetic.ArithmeticSettings(), "eval",
                                             limit=3)
  answers = [["7", "The answer is 7.", "no idea"],
             ["3 - 1 = 2, so 12", "-4", f"{questions[1].ground_truth}"],
             [f"{questions[2].ground_truth} or 1", "x", f"= {questions[2].ground_truth}"]]
  groups = [groups_lib.Group(
      data.Prompt(dataclasses.replace(q, reward_name="last_int"), (1, 2), q.problem, False),
      [groups_lib.Response(np.zeros(1, np.int32), np.zeros(1, np.float32), t) for t in texts])
      for q, texts in zip(questions, answers)]
  grader = grading.Grader(config)
  try:
    assert grader.pool.num_workers == 2
    stats = grader.grade(groups)
  finally:
    grader.close()
  for q, g, texts in zip(questions, groups, answers):
    expected = [float(_last_int_correct(t, q.ground_truth)) for t in texts]
    assert g.rewards.tolist() == expected
  assert stats["exceptions"] == 0 and stats["no_answer"] == 2  # "no idea", "x"
  assert 0 < stats["correct"] < 9

