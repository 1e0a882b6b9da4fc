"""One trainer per workdir: an exclusive `flock` on `<workdir>/lock`, held for the run.

  lock = workdir_lock.WorkdirLock.acquire(workdir)   # WorkdirLockedError if held
  ...
  lock.release()

The kernel drops a `flock` when its holder exits, however it exits (SIGKILL included),
so a lock file left by a killed run is free and is taken over; the file's JSON (pid,
host, start time) only names the holder in the refusal. Only process 0 of a
multi-process run locks (`primary`). `flock` needs a local or lock-aware network file system.
"""

import fcntl
import json
import os
import socket
import time

LOCK_NAME = "lock"


class WorkdirLockedError(RuntimeError):
  """Another live process holds the workdir."""


class WorkdirLock:
  """An acquired lock; `release()` (or process exit) frees it."""

  def __init__(self, path: str, fd: int | None):
    self.path = path
    self._fd = fd

  @classmethod
  def acquire(cls, workdir: str, primary: bool = True) -> "WorkdirLock":
    """Locks `workdir` (only if `primary`: process 0 of a multi-process run)."""
    path = os.path.join(os.path.abspath(workdir), LOCK_NAME)
    if not primary:
      return cls(path, None)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _describe(os.pread(fd, 4096, 0))
      os.close(fd)
      raise WorkdirLockedError(f"{os.path.dirname(path)} is in use by {holder} "
                               f"(lock file {path})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
    return cls(path, fd)

  def release(self, remove: bool = False) -> None:
    """Frees the lock; `remove` also deletes the lock file (a run that ended, or a start
    that was refused: the workdir is left without a file naming a process gone)."""
    if self._fd is not None:
      if remove:  # while still holding the flock, so no other trainer holds this file
        os.unlink(self.path)
      os.close(self._fd)  # closing the descriptor drops the flock
      self._fd = None


def _describe(raw: bytes) -> str:
  try:
    info = json.loads(raw)
    return f"pid {info['pid']} on {info['host']} (since {info['started']})"
  except (ValueError, KeyError, TypeError):
    return "another process"
