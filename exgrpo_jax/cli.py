"""What every command-line entry point shares: one-line errors, exit statuses, checks.

  def main(argv=None) -> int:
    args = parser.parse_args(argv)          # cli.add_debug_flag(parser) adds --debug
    return cli.guarded(lambda: _main(args), debug=args.debug)

Exit statuses (README, "Exit statuses"):
  0    done
  1    an error: bad data, model path, checkpoint, disk, ...: one line `error: ...`
       (`exgrpo_jax.train: ...` for training) on stderr; `--debug` prints its traceback
       instead (the exit status stays)
  2    bad arguments: argparse / absl flags, and `UsageError`s (the trainer's config
       keys and values, e.g. `--config.algo.rho=2.0`: one line per bad value, naming
       its key)
  75   preempted: SIGTERM or Ctrl-C stopped a training run after checkpointing its last
       complete step; rerunning the same command resumes (EX_TEMPFAIL of sysexits.h)
  130  interrupted during start-up or a second Ctrl-C (nothing new was checkpointed)
"""

import argparse
import json
import logging
import os
import sys
import traceback
from typing import Callable

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130


class UsageError(ValueError):
  """A bad argument found after parsing (a config key or value): exit status 2."""


def one_line(e: BaseException) -> str:
  """`e`'s message on one line: its first line, or where that is only a header (pydantic's
  "1 validation error for ModelConfig", a line ending in ':') the lines naming the cause;
  its type name when the message does not say much."""
  validation = _validation_errors(e)
  if validation:
    return validation
  lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
  text = lines[0] if lines else ""
  if text.endswith(":") and len(lines) > 1:
    text = f"{text} {lines[1]}"
  if isinstance(e, (KeyError, MemoryError, UnicodeError)) or not text:
    text = f"{type(e).__name__}: {text}".rstrip(": ")
  return text


def _validation_errors(e: BaseException) -> str | None:
  """A pydantic ValidationError (vLLM's config checks) as `Model: field: why; ...`."""
  if type(e).__name__ != "ValidationError" or not callable(getattr(e, "errors", None)):
    return None
  try:
    items = e.errors()
  except Exception:  # pylint: disable=broad-except
    return None
  parts = []
  for item in items:
    why = str(item.get("msg", "")).removeprefix("Value error, ").removeprefix(
        "Assertion failed, ")
    where = ".".join(map(str, item.get("loc", ())))
    parts.append(f"{where}: {why}" if where else why)
  title = getattr(e, "title", "")
  return (f"{title}: " if title else "") + "; ".join(parts) if parts else None


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
  """Runs `run`; any exception becomes one `{prefix}: ...` line and exit status 1, a
  UsageError one such line per line of its message and exit status 2. With `debug`
  the traceback is printed instead; the exit status is the same."""
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
      traceback.print_exc()
    elif isinstance(e, UsageError):
      for line in str(e).strip().splitlines():
        error(line, prefix)
    else:
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


def non_negative_int(text: str) -> int:
  """An argparse type: an integer >= 0."""
  value = int(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
  return value


def positive_float(text: str) -> float:
  """An argparse type: a finite number above 0."""
  value = float(text)
  if not 0 < value < float("inf"):
    raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
  return value


def read_json(flag: str, path: str):
  """The JSON of file `path`, named by `flag`; where it cannot be read or is not JSON, a
  UsageError in one line naming both."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except OSError as e:
    raise UsageError(f"{flag} {path}: {e.strerror}") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UsageError(f"{flag} {path}: not a JSON file ({e})") from None


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


def unwritable(path: str, directory: bool = False) -> str | None:
  """Why a file (with `directory`, a directory) cannot be written at `path`, its missing
  parents made as `os.makedirs` makes them; None where it can. Creates nothing: for
  outputs checked before long work starts."""
  path = os.path.abspath(path)
  if os.path.exists(path):
    if os.path.isdir(path) != directory:
      return f"{path} is {'not ' if directory else ''}a directory"
    return None if os.access(path, os.W_OK) else f"{path} is not writable"
  parent = os.path.dirname(path)
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    return f"{parent} is not a directory"
  return None if os.access(parent, os.W_OK | os.X_OK) else f"{parent} is not writable"
