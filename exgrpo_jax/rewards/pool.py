"""Verification in worker processes with a per-item deadline that always returns.

  with rewards.RewardPool(num_workers=4, timeout_s=10.0) as pool:
    rewards_N, stats = pool.score([rewards.RewardItem(text, gt, "math_verify", gate), ...])
    scores = pool.grade(items)   # also each item's status and exception text

Each item is sent to an idle worker on its own pipe, so the parent knows which item each
worker holds and since when. Two deadlines guard every item:

* soft, in the worker: SIGALRM after `timeout_s` interrupts the grader between Python
  bytecodes (e.g. sympy expanding `9^{9^{9}}`, which otherwise runs for minutes); the
  worker answers TIMEOUT and lives on;
* hard, in the parent: `timeout_s + grace_s` after dispatch a worker that has not
  answered (stuck inside C code, where signals wait) is killed and replaced, and its
  item is a TIMEOUT. A worker that dies mid-item gives CRASH and is replaced.

Either way the item scores 0 and is counted in the returned stats. Workers start with
`spawn` (never `fork`: the parent runs JAX's threads), ignore SIGINT and SIGTERM (the
parent owns shutdown: a SIGTERM to the process group must not turn the step being scored
into crashes) and cap their address space at `max_memory_mb` above what they started
with. A worker that dies while starting (e.g. killed before it set those handlers) is
replaced and counted in `restarts`; only a pool whose workers keep dying at start-up
(more than `2 * num_workers + 1` times) or report an import error gives up.
"""

import collections
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import threading
import time
from typing import Sequence

import numpy as np

from exgrpo_jax.rewards import graders

_READY = "ready"


@dataclasses.dataclass(frozen=True)
class RewardItem:
  """One response to grade: text, reference answer, reward name, think gate on/off."""

  response: str
  ground_truth: str
  reward_name: str
  think_gate: bool = False


class _Deadline(BaseException):
  """The per-item deadline passed (raised from SIGALRM; not an `Exception`, so graders'
  `except Exception` blocks do not swallow it)."""


def _on_alarm(signum, frame):
  del signum, frame
  raise _Deadline()


@dataclasses.dataclass
class Scores:
  """The grading of a batch of items, in their order.

  Attributes:
    rewards_N: float32 rewards (0 for every status but OK).
    status_N: each item's status (`graders.STATUSES`).
    error_N: "Type: message" (one line, at most 500 characters) of the exception an
      EXCEPTION item raised, else "".
    stats: counts of the batch (total, correct, timeouts, exceptions, ...) and seconds.
  """

  rewards_N: np.ndarray
  status_N: np.ndarray
  error_N: np.ndarray
  stats: dict


def grade_with_deadline(item: RewardItem, timeout_s: float) -> tuple[float, str, str]:
  """(reward, status, exception text) for one item, graded in this thread (which must be
  the main one)."""
  previous = signal.signal(signal.SIGALRM, _on_alarm)
  try:
    try:
      signal.setitimer(signal.ITIMER_REAL, timeout_s)
      return *graders.grade(item.response, item.ground_truth, item.reward_name,
                            item.think_gate), ""
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
  except _Deadline:
    return 0.0, graders.TIMEOUT, ""
  except Exception as e:  # pylint: disable=broad-except
    return 0.0, graders.EXCEPTION, f"{type(e).__name__}: {' '.join(str(e).split())}"[:500]
  finally:
    signal.signal(signal.SIGALRM, previous)


def _cap_address_space(max_memory_mb: int) -> None:
  """Limits this process's virtual memory to its current size plus `max_memory_mb`."""
  with open("/proc/self/statm") as f:
    current = int(f.read().split()[0]) * resource.getpagesize()
  limit = current + (max_memory_mb << 20)
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _worker_main(conn, timeout_s: float, plugin_modules: Sequence[str],
                 max_memory_mb: int) -> None:
  """A worker's loop: receive (index, item), answer (index, reward, status, error)."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  try:
    graders.load_plugins(plugin_modules)
    if max_memory_mb and os.path.exists("/proc/self/statm"):  # Linux; skipped elsewhere
      _cap_address_space(max_memory_mb)
  except Exception as e:  # pylint: disable=broad-except
    conn.send(("error", f"{type(e).__name__}: {e}"))
    return
  conn.send(_READY)
  while True:
    try:
      task = conn.recv()
    except EOFError:
      return
    if task is None:
      return
    index, item = task
    conn.send((index, *grade_with_deadline(item, timeout_s)))


class _Worker:
  """One worker process, its pipe, and the item it holds (index, hard deadline)."""

  def __init__(self, ctx, args):
    self.conn, child_conn = ctx.Pipe()
    self.process = ctx.Process(target=_worker_main, args=(child_conn, *args), daemon=True,
                               name="exgrpo-reward-worker")
    self.process.start()
    child_conn.close()
    self.ready = False
    self.started = time.monotonic()
    self.task: tuple[int, float] | None = None

  def kill(self) -> None:
    self.process.kill()
    self.process.join(timeout=10)
    self.conn.close()


class RewardPool:
  """Grades responses in `num_workers` processes; see the module docstring.

  Args:
    num_workers: worker processes; 0 grades in this process (debugging only: it needs
      the main thread for SIGALRM and cannot recover from a hang inside C code).
    timeout_s: per-item deadline.
    grace_s: extra time before a silent worker is killed.
    plugin_modules: modules every worker imports first, besides those of the rewards
      registered in this process (custom rewards registered in `graders.REWARDS` by user
      code).
    start_method: multiprocessing start method ("spawn" or "forkserver").
    max_memory_mb: address-space headroom per worker (0 = no cap); a grader that needs
      more fails with MemoryError and the item counts as an exception.
    startup_timeout_s: how long a new worker may take to import its modules.
    log_errors: log the first exception of each reward and exception type (callers that
      report exceptions themselves turn this off).
  """

  def __init__(self, num_workers: int = 4, timeout_s: float = 10.0, grace_s: float = 2.0,
               plugin_modules: Sequence[str] = (), start_method: str = "spawn",
               max_memory_mb: int = 4096, startup_timeout_s: float = 120.0,
               log_errors: bool = True):
    if num_workers < 0 or timeout_s <= 0:
      raise ValueError(f"RewardPool needs num_workers >= 0 and timeout_s > 0, got "
                       f"{num_workers} and {timeout_s}")
    self.num_workers = num_workers
    self.timeout_s = float(timeout_s)
    self.hard_timeout_s = float(timeout_s + grace_s)
    self.startup_timeout_s = startup_timeout_s
    self._ctx = multiprocessing.get_context(start_method)
    modules = tuple(dict.fromkeys((*graders.plugin_modules(), *plugin_modules)))
    self._args = (self.timeout_s, modules, max_memory_mb)
    if num_workers == 0:
      graders.load_plugins(plugin_modules)
    self.log_errors = log_errors
    self._logged = set()
    self._workers = [_Worker(self._ctx, self._args) for _ in range(num_workers)]
    self.restarts = 0
    self._start_deaths = 0
    try:
      while not all(w.ready for w in self._workers):
        starting = [w for w in self._workers if not w.ready]
        self._poll(starting, min(w.started for w in starting) + startup_timeout_s, None)
        self._check_startup()
    except RuntimeError:
      self.close()
      raise

  def score(self, items: Sequence[RewardItem]) -> tuple[np.ndarray, dict]:
    """(rewards float32 [N], stats) for `items`, in order."""
    scores = self.grade(items)
    return scores.rewards_N, scores.stats

  def score_with_status(self, items: Sequence[RewardItem]):
    """(rewards float32 [N], status [N] (one of graders.STATUSES), stats)."""
    scores = self.grade(items)
    return scores.rewards_N, scores.status_N, scores.stats

  def grade(self, items: Sequence[RewardItem]) -> Scores:
    """Rewards, statuses and exception texts of `items`, in order, with the stats."""
    start = time.perf_counter()
    restarts_before = self.restarts
    n = len(items)
    scores = Scores(np.zeros(n, np.float32), np.full(n, graders.OK, dtype=object),
                    np.full(n, "", dtype=object), {})
    if self.num_workers == 0:
      if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("RewardPool(num_workers=0) must be used from the main thread")
      for i, item in enumerate(items):
        scores.rewards_N[i], scores.status_N[i], scores.error_N[i] = grade_with_deadline(
            item, self.timeout_s)
    else:
      self._run(items, scores)
    counts = collections.Counter(scores.status_N.tolist())
    scores.stats = dict(total=n, correct=int((scores.rewards_N > 0).sum()),
                        timeouts=counts[graders.TIMEOUT], exceptions=counts[graders.EXCEPTION],
                        crashes=counts[graders.CRASH], format_failures=counts[graders.FORMAT],
                        no_answer=counts[graders.NO_ANSWER],
                        worker_restarts=self.restarts - restarts_before,
                        seconds=time.perf_counter() - start)
    if self.log_errors:
      self._log_new_errors(items, scores.error_N)
    return scores

  def _log_new_errors(self, items, error_N) -> None:
    """One warning for the first exception of each (reward, exception type)."""
    for item, error in zip(items, error_N):
      key = (item.reward_name, error.split(":", 1)[0])
      if error and key not in self._logged:
        self._logged.add(key)
        logging.warning("reward %r raised %s (scored 0; further ones are only counted, in "
                        "reward/exceptions)", item.reward_name, error)

  def _run(self, items, scores: Scores) -> None:
    if not self._workers:
      raise RuntimeError("RewardPool is closed")
    pending = collections.deque(range(len(items)))
    while pending or any(w.task for w in self._workers):
      for j, w in enumerate(self._workers):
        if w.ready and w.task is None and pending:
          index = pending.popleft()
          try:
            w.conn.send((index, items[index]))
          except (BrokenPipeError, OSError):  # died while idle: not the item's fault
            pending.appendleft(index)
            self._replace(j)
            continue
          w.task = (index, time.monotonic() + self.hard_timeout_s)
      busy = [w for w in self._workers if w.task or not w.ready]
      deadline = min(w.task[1] if w.task else w.started + self.startup_timeout_s
                     for w in busy)
      self._poll(busy, deadline, scores)
      self._check_startup()
      now = time.monotonic()
      for j, w in enumerate(self._workers):
        if w.task and now >= w.task[1]:
          scores.status_N[w.task[0]] = graders.TIMEOUT
          self._replace(j)

  def _poll(self, workers, deadline, scores: Scores | None) -> None:
    """Handles the messages (or deaths) of `workers` that arrive before `deadline`."""
    by_conn = {w.conn: (j, w) for j, w in enumerate(self._workers) if w in workers}
    timeout = max(0.0, deadline - time.monotonic())
    for conn in multiprocessing.connection.wait(list(by_conn), timeout=timeout):
      j, w = by_conn[conn]
      try:
        message = conn.recv()
      except (EOFError, OSError):
        if not w.ready:
          self._start_deaths += 1
          if self._start_deaths > 2 * self.num_workers + 1:
            raise RuntimeError(f"reward workers keep dying while starting "
                               f"({self._start_deaths} times; see their stderr)") from None
          self._replace(j)
          continue
        scores.status_N[w.task[0]] = graders.CRASH
        self._replace(j)
        continue
      if message == _READY:
        w.ready = True
      elif not w.ready:
        raise RuntimeError(f"a reward worker failed to start: {message[1]}")
      else:
        index, *result = message
        scores.rewards_N[index], scores.status_N[index], scores.error_N[index] = result
        w.task = None

  def _check_startup(self) -> None:
    now = time.monotonic()
    if any(not w.ready and now - w.started > self.startup_timeout_s for w in self._workers):
      raise RuntimeError(f"a reward worker did not start within {self.startup_timeout_s} s")

  def _replace(self, j: int) -> None:
    self._workers[j].kill()
    self._workers[j] = _Worker(self._ctx, self._args)
    self.restarts += 1

  def close(self) -> None:
    """Stops every worker (politely, then by force)."""
    for w in self._workers:
      try:
        w.conn.send(None)
      except (BrokenPipeError, OSError):
        pass
    for w in self._workers:
      w.process.join(timeout=2)
      if w.process.is_alive():
        w.process.kill()
      w.process.join(timeout=10)
      w.conn.close()
    self._workers = []

  def __enter__(self) -> "RewardPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
