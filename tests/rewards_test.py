"""Reward graders on hand-written cases from the shared data, and the worker pool's
timeouts, crashes and recovery."""

import subprocess
import sys
import time

import numpy as np
import pytest

from exgrpo_jax import rewards
from exgrpo_jax.rewards import graders

MV, MC, GSM = "math_verify", "multiple_choice", "gsm8k"
OK, FORMAT, NO_ANSWER = graders.OK, graders.FORMAT, graders.NO_ANSWER
# First ground truths of MATH-500 in exgrpo_test_id.parquet, and other real ones.
POLAR = "\\left( 3, \\frac{\\pi}{2} \\right)"

# (response, ground truth, reward, think gate, expected reward, expected status)
CASES = [
    # Equivalent forms (MATH-500, OlympiadBench, AMC, AIME ground truths).
    ("The answer is $\\boxed{0.5}$.", "\\frac{1}{2}", MV, False, 1, OK),
    ("So $x = \\boxed{\\frac{1}{2}}$", "0.5", MV, False, 1, OK),
    ("In polar form: $\\boxed{(3,\\pi/2)}$", POLAR, MV, False, 1, OK),
    ("$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$", POLAR, MV, False, 1, OK),
    ("\\boxed{p - q}", "p - q", MV, False, 1, OK),
    ("\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}", MV, False, 1, OK),
    ("The angle is \\boxed{90}", "90^\\circ", MV, False, 1, OK),
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", MV, False, 1, OK),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", MV, False, 1, OK),
    ("\\boxed{\\frac{1}{2n+2}}", "$\\frac{1}{2 n+2}$", MV, False, 1, OK),
    ("\\boxed{(1,8,19), (2,7,13), (4,5,7)}", "$(1,8,19), (2,7,13), (4,5,7)$", MV, False, 1, OK),
    ("\\boxed{\\frac{(2n)!}{(n!)^2}}", "$\\binom{2n}{n}$", MV, False, 1, OK),
    ("The final answer is \\boxed{25}", "025", MV, False, 1, OK),  # AIME, leading zero
    ("\\boxed{142}", "142.0", MV, False, 1, OK),  # AMC ground truths are floats
    ("\\boxed{1.6}", "1.6", MV, False, 1, OK),  # Minerva
    ("so $x = 5$, i.e. \\boxed{x=5}", "x=5", MV, False, 1, OK),
    ("The roots are \\boxed{1,-2}", "1,-2", MV, False, 1, OK),
    ("\\boxed{[2, 5)}", "[2,5)", MV, False, 1, OK),
    # Wrong answers.
    ("\\boxed{(3, \\pi)}", POLAR, MV, False, 0, OK),
    ("\\boxed{q - p}", "p - q", MV, False, 0, OK),
    ("\\boxed{4.67}", "\\frac{14}{3}", MV, False, 0, OK),  # a rounded value is not equal
    ("\\boxed{Bob}", "\\text{Evelyn}", MV, False, 0, OK),
    ("\\boxed{240}", "204", MV, False, 0, OK),
    ("\\boxed{-3}", "3", MV, False, 0, OK),
    ("I do not know how to solve this.", "42", MV, False, 0, NO_ANSWER),
    # Multiple boxed answers: a later sentence's box wins; hedged lists are a set.
    ("First \\boxed{3}. Actually the answer is \\boxed{5}.", "5", MV, False, 1, OK),
    ("It is either \\boxed{3} or \\boxed{5}", "5", MV, False, 0, OK),
    # The think gate (prompt ended with "<think>\n").
    ("Compute 2+3.</think>\nThe answer is \\boxed{5}", "5", MV, True, 1, OK),
    ("Compute 2+3 = 5. The answer is \\boxed{5}", "5", MV, True, 0, FORMAT),
    ("Maybe \\boxed{5}?</think> No: the answer is \\boxed{7}.", "5", MV, True, 0, OK),
    ("a</think> \\boxed{5} </think> \\boxed{7}", "5", MV, True, 1, OK),  # split("</think>")[1]
    ("<think>long</think> so \\boxed{5}", "5", MV, False, 1, OK),  # no gate: whole text
    # Multiple choice (ARC-c letters and digits, GPQA's "ANSWER: X").
    ("Faster rotation means shorter days. The answer is C.", "C", MC, False, 1, OK),
    ("\\boxed{C}", "C", MC, False, 1, OK),
    ("\\boxed{\\text{(C)}}", "C", MC, False, 1, OK),
    ("**Answer: C) Planetary days will become shorter.**", "C", MC, False, 1, OK),
    ("\\boxed{B}", "C", MC, False, 0, OK),
    ("Lifetimes give widths ~1e-7 eV.\nANSWER: A", "A", MC, False, 1, OK),
    ("Let me compare A and B.\nANSWER: D", "A", MC, False, 0, OK),
    ("The answer is 2) Kinetic energy increases.", "2", MC, False, 1, OK),
    ("Options A) x B) y.\nThe last line is the choice:\n(B)", "B", MC, False, 1, OK),
    ("I am not sure which one.", "C", MC, False, 0, NO_ANSWER),
    ("A is wrong, B is wrong.</think>\nAnswer: C", "C", MC, True, 1, OK),
    ("Answer: C", "C", MC, True, 0, FORMAT),
    # GSM8K numbers: commas, units, currency, "####".
    ("She sells 9 eggs at $2 each: 9 * 2 = 18.\n#### 18", "18", GSM, False, 1, OK),
    ("He makes $1,080 per week.", "1080", GSM, False, 1, OK),
    ("The answer is \\boxed{1,080}.", "1080", GSM, False, 1, OK),
    ("\\boxed{\\$18}", "18", GSM, False, 1, OK),
    ("The answer is 18.00 dollars", "18", GSM, False, 1, OK),
    ("Johnny picks up 500 + 1500 + 125 = 2,125 blocks.", "2125", GSM, False, 1, OK),
    ("#### 18\n\nCheck: 3 + 4 = 7", "18", GSM, False, 1, OK),  # "####" beats later numbers
    ("The answer is 70 clips.", "72", GSM, False, 0, OK),
    ("Natalia sold 48 + 24 = 72 clips, minus 2 lost: 70.", "72", GSM, False, 0, OK),
    ("I cannot solve this one.", "18", GSM, False, 0, NO_ANSWER),
    ("9 * 2 = 18 dollars", "18", GSM, True, 0, FORMAT),
]


@pytest.mark.parametrize("response,truth,name,gate,expected,status", CASES)
def test_grade_table(response, truth, name, gate, expected, status):
  assert graders.grade(response, truth, name, gate) == (float(expected), status)


def test_table_size_and_pool_agreement():
  """The whole table through worker processes gives the in-process answers."""
  assert len(CASES) >= 40
  items = [rewards.RewardItem(r, t, n, g) for r, t, n, g, _, _ in CASES]
  with rewards.RewardPool(num_workers=2, timeout_s=10.0) as pool:
    rewards_N, status_N, stats = pool.score_with_status(items)
  np.testing.assert_array_equal(rewards_N, np.array([c[4] for c in CASES], np.float32))
  assert status_N.tolist() == [c[5] for c in CASES]
  assert stats["total"] == len(CASES)
  assert stats["correct"] == sum(c[4] for c in CASES)
  assert stats["format_failures"] == sum(c[5] == FORMAT for c in CASES)
  assert stats["no_answer"] == sum(c[5] == NO_ANSWER for c in CASES)
  assert stats["timeouts"] == stats["crashes"] == stats["exceptions"] == 0


def test_known_math_verify_limitations_match_the_reference():
  """Minerva ground truths written as code, not LaTeX, defeat `parse("$" + gt + "$")`.

  The reference's reward has the same blind spot (same call); these pin the behaviour
  so a change in it is noticed.
  """
  assert graders.grade("\\boxed{4.5 \\times 10^{33}}", "4.5e33", MV, False) == (0.0, OK)
  assert graders.grade("\\boxed{-\\frac{1}{3}}", "-1./3", MV, False) == (0.0, OK)
  assert graders.grade("\\boxed{4.5e33}", "4.5e33", MV, False) == (1.0, OK)


def test_routing_by_data_source():
  assert graders.reward_for_source("arc_c") == MC
  assert graders.reward_for_source("gpqa") == MC
  assert graders.reward_for_source("mmlu_pro") == MC
  assert graders.reward_for_source("gsm8k") == GSM
  assert graders.reward_for_source("aime") == MV
  assert graders.reward_for_source("DigitalLearningGmbH/MATH-lighteval") == MV
  assert graders.reward_for_source("arc_c", override=MV) == MV
  with pytest.raises(KeyError, match="unknown reward 'nope'"):
    graders.reward_for_source("aime", override="nope")


def test_math_verify_boxed_only_reads_the_last_box():
  assert graders.grade("x is 5, so \\boxed{\\frac12}", "0.5", "math_verify_boxed", False) == (
      1.0, OK)
  assert graders.grade("The answer is 5", "5", "math_verify_boxed", False) == (0.0, NO_ANSWER)
  assert graders.grade("The answer is 5", "5", MV, False) == (1.0, OK)


def test_last_boxed_balances_braces():
  assert graders.last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
  assert graders.last_boxed("\\fbox{x^{2}}") == "x^{2}"
  assert graders.last_boxed("unclosed \\boxed{\\frac{1}{2}") is None
  assert graders.last_boxed("no box") is None


# Expanding 9^(9^9) exactly makes an unguarded `verify(parse(...))` run for minutes
# (measured: still running after 180 s on this machine).
PATHOLOGICAL = rewards.RewardItem("The answer is $\\boxed{9^{9^{9}}}$", "5", MV)


@pytest.mark.slow
def test_pathological_input_runs_long_without_a_deadline():
  code = ("import math_verify as m; m.verify(m.parse('$5$', parsing_timeout=None), "
          f"m.parse({PATHOLOGICAL.response!r}, parsing_timeout=None), timeout_seconds=None)")
  with pytest.raises(subprocess.TimeoutExpired):
    subprocess.run([sys.executable, "-c", code], timeout=30, check=True)


def test_pathological_input_times_out_and_the_pool_recovers():
  normal = [rewards.RewardItem("\\boxed{0.5}", "\\frac{1}{2}", MV),
            rewards.RewardItem("#### 72", "72", GSM)]
  with rewards.RewardPool(num_workers=1, timeout_s=1.0, grace_s=2.0) as pool:
    start = time.perf_counter()
    rewards_N, status_N, stats = pool.score_with_status([PATHOLOGICAL] + normal)
    elapsed = time.perf_counter() - start
    assert rewards_N.tolist() == [0.0, 1.0, 1.0]
    assert status_N.tolist() == [graders.TIMEOUT, OK, OK]
    assert stats["timeouts"] == 1 and stats["correct"] == 2
    assert stats["worker_restarts"] == 0  # the soft deadline kept the worker alive
    assert elapsed < 8.0  # cut off at the 1 s soft deadline, not minutes later
    rewards_N, stats = pool.score(normal * 3)  # the next batch verifies normally
    assert rewards_N.tolist() == [1.0] * 6 and stats["timeouts"] == 0


def test_hang_in_c_is_killed_and_replaced():
  items = [rewards.RewardItem("x", "1", "test_hang_in_c"),
           rewards.RewardItem("\\boxed{2}", "2", MV)]
  with rewards.RewardPool(num_workers=1, timeout_s=0.5, grace_s=1.0,
                          plugin_modules=["tests.reward_plugins"]) as pool:
    start = time.perf_counter()
    rewards_N, status_N, stats = pool.score_with_status(items)
    assert time.perf_counter() - start < 20.0  # hard deadline 1.5 s + a worker restart
    assert rewards_N.tolist() == [0.0, 1.0]
    assert status_N.tolist() == [graders.TIMEOUT, OK]
    assert stats["timeouts"] == 1 and stats["worker_restarts"] == 1
    rewards_N, stats = pool.score([items[1]] * 2)
    assert rewards_N.tolist() == [1.0, 1.0] and stats["worker_restarts"] == 0


def test_crash_and_exception_score_zero_and_are_counted():
  items = [rewards.RewardItem("x", "1", "test_crash"),
           rewards.RewardItem("x", "1", "test_raise"),
           rewards.RewardItem("\\boxed{3}", "3", MV)]
  with rewards.RewardPool(num_workers=2, timeout_s=5.0,
                          plugin_modules=["tests.reward_plugins"]) as pool:
    rewards_N, status_N, stats = pool.score_with_status(items)
    assert rewards_N.tolist() == [0.0, 0.0, 1.0]
    assert status_N.tolist() == [graders.CRASH, graders.EXCEPTION, OK]
    assert (stats["crashes"], stats["exceptions"], stats["worker_restarts"]) == (1, 1, 1)
    assert pool.score(items[2:] * 4)[0].tolist() == [1.0] * 4


def test_exceptions_come_back_with_their_text_and_are_logged_once(caplog):
  items = [rewards.RewardItem(f"x{i}", "1", "test_raise") for i in range(3)]
  with rewards.RewardPool(num_workers=1, plugin_modules=["tests.reward_plugins"]) as pool:
    scores = pool.grade(items)
    pool.grade(items)
  assert scores.status_N.tolist() == [graders.EXCEPTION] * 3
  assert scores.error_N.tolist() == [f"ValueError: cannot grade 'x{i}' against '1'"
                                     for i in range(3)]
  assert scores.stats["exceptions"] == 3
  assert [r.getMessage() for r in caplog.records] == [
      "reward 'test_raise' raised ValueError: cannot grade 'x0' against '1' (scored 0; "
      "further ones are only counted, in reward/exceptions)"]


def test_in_process_mode_still_times_out():
  with rewards.RewardPool(num_workers=0, timeout_s=1.0) as pool:
    rewards_N, status_N, stats = pool.score_with_status(
        [PATHOLOGICAL, rewards.RewardItem("\\boxed{5}", "5", MV)])
  assert rewards_N.tolist() == [0.0, 1.0]
  assert status_N.tolist() == [graders.TIMEOUT, OK] and stats["timeouts"] == 1


def test_bad_plugin_fails_loudly_at_start():
  with pytest.raises(RuntimeError, match="reward plugin module 'no_such_reward_module'"):
    rewards.RewardPool(num_workers=1, plugin_modules=["no_such_reward_module"])
