"""Guards of a training run: stop signals, the non-finite stop and start-up checks (a
resumed run's logs are cut back by `run_log.truncate`).

  with run_guard.StopSignals() as stop:     # SIGTERM / Ctrl-C: finish the step, stop
    while ... and not stop.requested: ...

A first SIGTERM or SIGINT lets the current step finish (reward workers ignore both, so
the step is scored exactly as in an uninterrupted run); the trainer then checkpoints
it and the command exits with `cli.EXIT_PREEMPTED`. A second SIGINT abandons the step
(KeyboardInterrupt): the last checkpoint stays the newest complete step.
"""

import math
import os
import signal
import sys
import threading

import jax


class NonFiniteError(RuntimeError):
  """The loss became NaN or infinite: the run stops before checkpointing it."""


class StopSignals:
  """Records the first SIGTERM/SIGINT in `requested` (its name) while active."""

  def __init__(self):
    self.requested: str | None = None
    self._previous = {}

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for signum in (signal.SIGTERM, signal.SIGINT):
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.requested and signum == signal.SIGINT:
      raise KeyboardInterrupt
    if not self.requested:
      self.requested = name
      print(f"{name}: finishing the current step, then checkpointing and exiting "
            "(Ctrl-C again abandons the step)", file=sys.stderr, flush=True)


def check_finite(step: int, metrics: dict, last_checkpoint: int | None) -> None:
  """Raises NonFiniteError if the step's loss is not finite (big_vision's stop rule)."""
  loss = metrics.get("actor/loss")
  if loss is not None and not math.isfinite(loss):
    kept = (f"the last checkpoint (step {last_checkpoint}) is kept" if last_checkpoint
            else "no checkpoint was written")
    raise NonFiniteError(f"step {step}: actor/loss is {loss}; stopping the run before "
                         f"checkpointing it ({kept})")


def check_context(prompt_lengths, max_new_tokens: int, model_cfg) -> None:
  """Raises ValueError at start-up if the longest prompt plus `max_new_tokens` does not
  fit the model's positions (else the first rollout would fail)."""
  longest = max(prompt_lengths)
  if longest + max_new_tokens > model_cfg.max_position_embeddings:
    raise ValueError(f"rollout.max_new_tokens={max_new_tokens} plus the longest prompt "
                     f"({longest} tokens) exceeds the model's "
                     f"{model_cfg.max_position_embeddings} positions; lower it or "
                     "data.max_prompt_tokens")


# The share of each GPU the configs' meshes and rollout.max_rows were planned for
# (docs/aot.md, "Memory plan"); JAX preallocates 0.75 unless told otherwise.
PLANNED_GPU_FRACTION = 0.95


def warn_gpu_memory_fraction(engine: str, environ=os.environ) -> str | None:
  """On NVIDIA GPUs with the JAX engine and no XLA_PYTHON_CLIENT_MEM_FRACTION, prints
  (and returns) one line: JAX's default share is below what the configs assume."""
  if (engine != "jax" or jax.default_backend() != "gpu"
      or "XLA_PYTHON_CLIENT_MEM_FRACTION" in environ):
    return None
  line = (f"[exgrpo_jax] warning: JAX preallocates 0.75 of each GPU; the configs' mesh and "
          f"rollout.max_rows are planned for {PLANNED_GPU_FRACTION} (docs/aot.md, \"Memory "
          f"plan\"): set XLA_PYTHON_CLIENT_MEM_FRACTION={PLANNED_GPU_FRACTION} or lower "
          "rollout.max_rows")
  print(line, file=sys.stderr, flush=True)
  return line
