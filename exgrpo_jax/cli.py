"""What every command-line entry point shares: one-line errors, exit statuses, checks.

  def main(argv=None) -> int:
    args = parser.parse_args(argv)          # cli.add_debug_flag(parser) adds --debug
    return cli.guarded(lambda: _main(args), debug=args.debug)

Exit statuses (README, "Exit statuses"):
  0    done
  1    an error: bad data, model path, checkpoint, disk, ...: one line `error: ...`
       (`exgrpo_jax.train: ...` for training) on stderr; `--debug` re-raises it with
       its traceback
  2    bad arguments: argparse / absl flags, and `UsageError`s (the trainer's config
       keys and values, e.g. `--config.algo.rho=2.0`, one line naming the key)
  75   preempted: SIGTERM or Ctrl-C stopped a training run after checkpointing its last
       complete step; rerunning the same command resumes (EX_TEMPFAIL of sysexits.h)
  130  interrupted during start-up or a second Ctrl-C (nothing new was checkpointed)
"""

import argparse
import logging
import os
import sys
from typing import Callable

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130


class UsageError(ValueError):
  """A bad argument found after parsing (a config key or value): exit status 2."""


def one_line(e: BaseException) -> str:
  """`e`'s message on one line (its type name when the message does not say much)."""
  lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
  text = lines[0] if lines else ""
  if isinstance(e, (KeyError, MemoryError, UnicodeError)) or not text:
    text = f"{type(e).__name__}: {text}".rstrip(": ")
  return text


def error(message: str, prefix: str = "error") -> int:
  print(f"{prefix}: {message}", file=sys.stderr, flush=True)
  return EXIT_ERROR


class _DropLibraryErrors(logging.Filter):
  """Drops Orbax's own error logs (tracebacks from its writer threads): the exception
  they accompany reaches us and is reported on one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


_DROP_LIBRARY_ERRORS = _DropLibraryErrors()


def _one_line_hook(kind, value, tb) -> None:
  """For errors that C callbacks print through sys.excepthook (TensorStore's writes that
  finish after a failed checkpoint closed Orbax's event loop): one line at most."""
  del kind, tb
  if not (isinstance(value, RuntimeError) and "Event loop is closed" in str(value)):
    print(f"error: {one_line(value)}", file=sys.stderr, flush=True)


def guarded(run: Callable[[], int | None], debug: bool = False, prefix: str = "error") -> int:
  """Runs `run`; any exception becomes one `{prefix}: ...` line and exit status 1 (2 for
  a UsageError)."""
  if not debug:  # for the whole process: late library output comes after `run` returns
    logging.getLogger("absl").addFilter(_DROP_LIBRARY_ERRORS)
    sys.excepthook = _one_line_hook
  try:
    return run() or 0
  except KeyboardInterrupt:
    if debug:
      raise
    print("interrupted", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
  except Exception as e:  # pylint: disable=broad-except
    if debug:
      raise
    error(one_line(e), prefix)
    return EXIT_USAGE if isinstance(e, UsageError) else EXIT_ERROR


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--debug", action="store_true",
                      help="show the traceback of an error instead of one line")


def positive_int(text: str) -> int:
  """An argparse type: an integer >= 1."""
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
  return value


def check_writable(path: str) -> None:
  """Raises OSError unless a file can be written at `path` (before long work starts)."""
  if os.path.isdir(path):
    raise IsADirectoryError(f"{path} is a directory")
  existed = os.path.exists(path)
  try:
    with open(path, "a", encoding="utf-8"):
      pass
  except OSError as e:
    raise OSError(f"cannot write {path}: {e.strerror}") from None
  if not existed:
    os.remove(path)
