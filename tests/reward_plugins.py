"""Test rewards (misbehaving ones for the pool's failure tests, a deterministic mixed one
for training runs), imported by workers as a plugin.

Not a test file (pytest collects `*_test.py` only); `RewardPool(plugin_modules=
["tests.reward_plugins"])` makes every worker import it, which registers these names.
"""

import os
import signal
import time

from exgrpo_jax.rewards import graders


@graders.REWARDS.register("test_hang_in_c")
def hang_in_c(solution: str, ground_truth: str) -> float:
  """Sleeps with SIGALRM blocked, like a long computation inside C code."""
  del solution, ground_truth
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
  time.sleep(3600)
  return 1.0


@graders.REWARDS.register("test_crash")
def crash(solution: str, ground_truth: str) -> float:
  """Kills its worker process outright."""
  del solution, ground_truth
  os._exit(3)


@graders.REWARDS.register("test_raise")
def raise_error(solution: str, ground_truth: str) -> float:
  """A grader bug: raises an ordinary exception."""
  raise ValueError(f"cannot grade {solution!r} against {ground_truth!r}")


@graders.REWARDS.register("test_even_length")
def even_length(solution: str, ground_truth: str) -> float:
  """1 when the response text has an even number of characters: a deterministic, mixed
  reward for random-weight models (their groups then fill the replay buffer)."""
  del ground_truth
  return float(len(solution) % 2 == 0)


@graders.REWARDS.register("test_slow_even_length")
def slow_even_length(solution: str, ground_truth: str) -> float:
  """`test_even_length` after 0.1 s, appending a line to $EXGRPO_TEST_SCORING_LOG (if
  set) first: lets a test signal a trainer while it is scoring."""
  log = os.environ.get("EXGRPO_TEST_SCORING_LOG")
  if log:
    with open(log, "a", encoding="utf-8") as f:
      f.write("scoring\n")
  time.sleep(0.1)
  return even_length(solution, ground_truth)


# A slow start for the pool's "killed while starting" test: the first worker to import
# this module (the marker file does not exist yet) sleeps before it is ready.
_SLOW_START_MARKER = os.environ.get("EXGRPO_TEST_SLOW_START_MARKER")
if _SLOW_START_MARKER and not os.path.exists(_SLOW_START_MARKER):
  with open(_SLOW_START_MARKER, "w", encoding="utf-8") as _f:
    _f.write(str(os.getpid()))
  time.sleep(30)
