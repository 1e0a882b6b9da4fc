"""Run logging: a JSONL file, TensorBoard event files and a one-line console progress bar.

Metric names follow the reference implementation (`batch/solved`, `experience/*`,
`bucket/{k}_count`, `actor/*`, `response_length/*`, `timing_s/*`, `val/*`), so plots
and dashboards read the same. Only process 0 writes.
"""

import json
import math
import os
import sys
import time

import jax
import numpy as np


class RunLog:
  """Appends metrics to `<workdir>/metrics.jsonl` and TensorBoard; prints progress."""

  def __init__(self, workdir: str, total_steps: int, start_step: int = 0):
    self.enabled = jax.process_index() == 0
    self.total_steps = total_steps
    self._start_time = time.time()
    self._start_step = start_step
    self._tb = None
    if self.enabled:
      os.makedirs(workdir, exist_ok=True)
      self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
      except ImportError:
        print("[exgrpo_jax] tensorboardX not installed: no TensorBoard events",
              file=sys.stderr)

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    clean = {k: _to_float(v) for k, v in metrics.items()}
    self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in clean.items():
        if v is not None and math.isfinite(v):
          self._tb.add_scalar(k, v, step)
      self._tb.flush()

  def progress(self, step: int, metrics: dict) -> None:
    """One console line: step, ETA and the headline metrics."""
    if not self.enabled:
      return
    done = step - self._start_step
    elapsed = time.time() - self._start_time
    eta = elapsed / max(done, 1) * (self.total_steps - step)
    keys = ("batch/solved", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
            "experience/questions", "experience/retired", "response_length/mean",
            "timing_s/step")
    parts = [f"{k.split('/')[-1]}={_to_float(metrics[k]):.4g}" for k in keys if k in metrics]
    print(f"step {step}/{self.total_steps} [{_hms(elapsed)}<{_hms(eta)}] " + " ".join(parts),
          flush=True)

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()


def _to_float(v):
  if v is None:
    return None
  return float(np.asarray(v))


def _hms(seconds: float) -> str:
  seconds = int(seconds)
  return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def read_metrics(workdir: str) -> list[dict]:
  """All rows of `<workdir>/metrics.jsonl` (for plots and tests)."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
