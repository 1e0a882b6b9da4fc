"""The generated arithmetic source: seeded, held-out split disjoint, answers graded right."""

import dataclasses
import importlib
import re

import pytest

from exgrpo_jax import rewards
from exgrpo_jax.data import arithmetic
from exgrpo_jax.data import sources
from exgrpo_jax.training import config_check

SETTINGS = arithmetic.ArithmeticSettings(train_size=300, eval_size=60,
                                         operations="add,sub,mul,mixed", max_operand=99)
_EXPRESSION = re.compile(r"What is (\d+) (\+|-|\\times) (\d+)(?: \+ (\d+))?\?")


def _value(problem: str) -> int:
  """The problem's value, computed independently of the generator."""
  a, op, b, c = _EXPRESSION.match(problem).groups()
  a, b = int(a), int(b)
  value = {"+": a + b, "-": a - b, "\\times": a * b}[op]
  return value + int(c) if c is not None else value


def test_same_settings_same_questions_and_seed_changes_them():
  first = arithmetic.make_questions(SETTINGS, "train")
  assert first == arithmetic.make_questions(SETTINGS, "train")
  other = arithmetic.make_questions(dataclasses.replace(SETTINGS, seed=1), "train")
  assert [q.problem for q in first] != [q.problem for q in other]
  assert [q.uid for q in first] == list(range(SETTINGS.train_size))


def test_splits_are_disjoint_and_without_repeats():
  train = {q.problem for q in arithmetic.make_questions(SETTINGS, "train")}
  held_out = {q.problem for q in arithmetic.make_questions(SETTINGS, "eval")}
  assert (len(train), len(held_out)) == (SETTINGS.train_size, SETTINGS.eval_size)
  assert not train & held_out


def test_answers_are_the_expressions_values_and_operations_alternate():
  questions = arithmetic.make_questions(SETTINGS, "eval")
  for q in questions:
    assert q.ground_truth == str(_value(q.problem)), q.problem
    assert int(q.ground_truth) >= 0
    assert q.problem.endswith(SETTINGS.instruction)
    assert q.reward_name == arithmetic.REWARD
  ops = SETTINGS.operation_list
  assert [q.data_source for q in questions[:len(ops)]] == [f"arith_{op}" for op in ops]
  big = arithmetic.make_questions(dataclasses.replace(SETTINGS, max_operand=50), "eval")
  assert max(int(n) for q in big for n in re.findall(r"\d+", q.problem)) <= 50


def test_reward_pool_grades_the_answers():
  questions = arithmetic.make_questions(SETTINGS, "eval", limit=8)
  responses = []
  for q in questions:
    value = int(q.ground_truth)
    responses += [(q, f"{q.ground_truth}"), (q, f"So the answer is {value}."),
                  (q, f"\\boxed{{{value}}}"), (q, f"{value + 1}"), (q, "I cannot say.")]
  with rewards.RewardPool(num_workers=1) as pool:
    reward_N, status_N, _ = pool.score_with_status(
        [rewards.RewardItem(text, q.ground_truth, q.reward_name, False)
         for q, text in responses])
  assert list(reward_N) == [1.0, 1.0, 1.0, 0.0, 0.0] * len(questions)
  assert list(status_N[4::5]) == ["no_answer"] * len(questions)


@pytest.mark.parametrize("change,message", [
    (dict(operations="add,pow"), "operations='add,pow'"),
    (dict(max_operand=1), "max_operand=1"),
    (dict(eval_size=0), "both must be positive"),
])
def test_bad_settings_name_the_field(change, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    arithmetic.ArithmeticSettings.parse(";".join(f"{k}={v}" for k, v in change.items()))
  with pytest.raises(ValueError, match=re.escape(message)):
    dataclasses.replace(SETTINGS, **change)


def test_parse_reads_fields_and_rejects_unknown_ones():
  parsed = arithmetic.ArithmeticSettings.parse("operations=add;max_operand=20;eval_size=5")
  assert parsed == arithmetic.ArithmeticSettings(operations="add", max_operand=20, eval_size=5)
  with pytest.raises(ValueError, match="unknown field 'digits'"):
    arithmetic.ArithmeticSettings.parse("digits=2")
  with pytest.raises(ValueError, match="max_operand must be an integer"):
    arithmetic.ArithmeticSettings.parse("max_operand=ten")


def test_too_few_distinct_problems_is_a_clear_error():
  small = dataclasses.replace(SETTINGS, operations="add", max_operand=3, train_size=20)
  with pytest.raises(ValueError, match="only .* distinct 'add' problems with max_operand=3"):
    arithmetic.make_questions(small, "train")


def test_config_sources_load_the_splits_and_check_them():
  c = importlib.import_module("configs.smollm2_135m").get_config()
  assert (c.data.source, c.eval.source) == ("arithmetic", "arithmetic")
  config_check.check(c)  # no data files needed
  train, held_out = sources.load(c, "train"), sources.load(c, "eval")
  assert len(held_out.questions) == c.eval.limit
  assert not {q.problem for q in train.questions} & {q.problem for q in held_out.questions}
  c.reward.name = "math_verify"
  assert {q.reward_name for q in sources.load(c, "train").questions} == {"math_verify"}
  c.data.arithmetic.train_size = 10**6
  with pytest.raises(config_check.ConfigError, match="config.data.arithmetic=.*distinct"):
    config_check.check(c)
  c.data.arithmetic.train_size = 100
  c.data.source = "nope"
  with pytest.raises(config_check.ConfigError, match="config.data.source='nope'"):
    config_check.check(c)


def test_eval_cli_names_a_bad_arithmetic_setting(capsys):
  from exgrpo_jax import eval as eval_cli  # pylint: disable=g-import-not-at-top
  assert eval_cli.main(["--data", "arithmetic:digits=2"]) == 1
  assert "error: arithmetic setting 'digits=2': unknown field 'digits'" in capsys.readouterr().err
