"""The workdir lock: a second holder is refused with one line naming the first (pid,
host); a lock left by a SIGKILLed process is taken over."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from exgrpo_jax import workdir_lock

_HOLD = """
import sys, time
from exgrpo_jax import workdir_lock
workdir_lock.WorkdirLock.acquire(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def _holder(workdir) -> subprocess.Popen:
  proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(workdir)], stdout=subprocess.PIPE,
                          text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert proc.stdout.readline().strip() == "locked"
  return proc


def test_second_holder_is_refused_with_the_first_ones_pid_and_host(tmp_path):
  proc = _holder(tmp_path)
  try:
    with pytest.raises(workdir_lock.WorkdirLockedError) as e:
      workdir_lock.WorkdirLock.acquire(str(tmp_path))
  finally:
    proc.kill()
    proc.wait()
  message = str(e.value)
  assert "\n" not in message
  assert f"pid {proc.pid} on {socket.gethostname()}" in message


def test_lock_of_a_killed_run_is_taken_over(tmp_path):
  proc = _holder(tmp_path)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  lock = workdir_lock.WorkdirLock.acquire(str(tmp_path))
  with open(lock.path, encoding="utf-8") as f:
    assert json.load(f)["pid"] == os.getpid()
  lock.release()


def test_release_frees_it_within_one_process(tmp_path):
  lock = workdir_lock.WorkdirLock.acquire(str(tmp_path))
  with pytest.raises(workdir_lock.WorkdirLockedError, match=f"pid {os.getpid()}"):
    workdir_lock.WorkdirLock.acquire(str(tmp_path))
  lock.release()
  workdir_lock.WorkdirLock.acquire(str(tmp_path)).release()
