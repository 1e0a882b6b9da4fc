"""Reward workers under signals: SIGTERM and SIGINT are ignored (the trainer owns
shutdown), and a worker killed while starting is replaced and counted."""

import multiprocessing
import os
import signal
import threading
import time

from exgrpo_jax import rewards
from exgrpo_jax.rewards import graders

ITEMS = [rewards.RewardItem("abcd", "", "test_even_length"),
         rewards.RewardItem("abc", "", "test_even_length")]


def test_workers_ignore_sigterm_and_sigint_of_the_process_group():
  with rewards.RewardPool(num_workers=2, plugin_modules=["tests.reward_plugins"]) as pool:
    for child in multiprocessing.active_children():
      if child.name == "exgrpo-reward-worker":
        os.kill(child.pid, signal.SIGTERM)
        os.kill(child.pid, signal.SIGINT)
    time.sleep(0.5)
    rewards_N, status_N, stats = pool.score_with_status(ITEMS)
  assert rewards_N.tolist() == [1.0, 0.0]
  assert status_N.tolist() == [graders.OK, graders.OK]
  assert stats["crashes"] == 0 and stats["worker_restarts"] == 0


def test_worker_killed_while_starting_is_replaced_and_counted(tmp_path, monkeypatch):
  marker = str(tmp_path / "started")
  monkeypatch.setenv("EXGRPO_TEST_SLOW_START_MARKER", marker)
  # The first worker sleeps at import; kill it then (from a thread: the pool's constructor
  # blocks until every worker is ready).

  def kill_first_worker():
    while not _read(marker):
      time.sleep(0.05)
    os.kill(int(_read(marker)), signal.SIGKILL)

  killer = threading.Thread(target=kill_first_worker, daemon=True)
  killer.start()
  with rewards.RewardPool(num_workers=1, plugin_modules=["tests.reward_plugins"]) as pool:
    killer.join()
    assert pool.restarts == 1
    rewards_N, stats = pool.score(ITEMS)
  assert rewards_N.tolist() == [1.0, 0.0] and stats["crashes"] == 0


def _read(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except FileNotFoundError:
    return ""
