"""Run logging: metric loggers by name, the resolved config, evaluation samples, progress.

  log = RunLog(workdir, total_steps, start_step, loggers="jsonl,tensorboard", config=c)
  log.write(step, metrics); log.progress(step, metrics); log.eval_samples(step, responses)

Loggers (`train.loggers`, comma-separated): `jsonl` (`<workdir>/metrics.jsonl`),
`tensorboard` (`<workdir>/tensorboard`, needs tensorboardX) and `wandb` (Weights & Biases,
when installed; project `$WANDB_PROJECT` or "exgrpo_jax", one run per workdir, resumed
with it). At start the resolved config goes to `<workdir>/config.json`; every evaluation
appends a few graded completions to `<workdir>/eval_samples.jsonl` and prints them.

Metric names follow the reference implementation (`batch/solved`, `experience/*`,
`bucket/{k}_count`, `actor/*`, `response_length/*`, `timing_s/*`, `val/*`), so plots
and dashboards read the same. Only process 0 writes.
"""

import importlib.util
import json
import math
import os
import sys
import time

import jax
import numpy as np

from exgrpo_jax import registry

LOGGERS = registry.Registry("logger")

# (metric, label) pairs of the console progress line, when present.
PROGRESS = (("batch/solved", "solved"), ("experience/batch_size", "replayed"),
            ("experience/questions", "buffer"), ("experience/retired", "retired"),
            ("val/avg_score", "val"), ("val/greedy_score", "val_greedy"),
            ("actor/pg_loss", "pg_loss"),
            ("actor/entropy", "entropy"), ("response_length/mean", "len"),
            ("timing_s/step", "step_s"))


def parse_loggers(names: str) -> list[str]:
  """The logger names of `train.loggers`; ValueError for unknown or uninstalled ones."""
  parsed = [n.strip() for n in names.split(",") if n.strip()]
  for name in parsed:
    if name not in LOGGERS:
      raise ValueError(f"unknown logger {name!r}; choose from {', '.join(LOGGERS.names())}")
  if "wandb" in parsed and importlib.util.find_spec("wandb") is None:
    raise ValueError("logger 'wandb' needs the wandb package: pip install wandb")
  return parsed


@LOGGERS.register("jsonl")
class JsonlLogger:
  """One JSON object per step in `<workdir>/metrics.jsonl` (appended across resumes)."""

  def __init__(self, workdir: str, config):
    del config
    self._file = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")

  def write(self, step: int, metrics: dict) -> None:
    self._file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()


@LOGGERS.register("tensorboard")
class TensorBoardLogger:
  """TensorBoard scalars under `<workdir>/tensorboard` (skipped if tensorboardX is absent)."""

  def __init__(self, workdir: str, config):
    del config
    try:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._writer = SummaryWriter(os.path.join(workdir, "tensorboard"))
    except ImportError:
      self._writer = None
      print("[exgrpo_jax] tensorboardX not installed: no TensorBoard events",
            file=sys.stderr)

  def write(self, step: int, metrics: dict) -> None:
    if self._writer is None:
      return
    for k, v in metrics.items():
      if v is not None and math.isfinite(v):
        self._writer.add_scalar(k, v, step)
    self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()


@LOGGERS.register("wandb")
class WandbLogger:
  """A Weights & Biases run; its id is kept in `<workdir>/wandb_id` so a resume continues it.

  The first session lets wandb pick the id (`run.id`, public API) and keeps it; later ones
  pass it back with resume="allow". Offline (`WANDB_MODE=offline`) each session writes
  `<workdir>/wandb/offline-run-<time>-<id>`; `wandb sync` uploads them as one run.
  """

  def __init__(self, workdir: str, config):
    import wandb  # pylint: disable=g-import-not-at-top
    id_path = os.path.join(workdir, "wandb_id")
    run_id = None
    if os.path.exists(id_path):
      with open(id_path, encoding="utf-8") as f:
        run_id = f.read().strip() or None
    self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "exgrpo_jax"), id=run_id,
                           name=os.path.basename(os.path.abspath(workdir)), dir=workdir,
                           config=config, resume="allow")
    if run_id is None:
      with open(id_path, "w", encoding="utf-8") as f:
        f.write(self._run.id)

  def write(self, step: int, metrics: dict) -> None:
    self._run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

  def close(self) -> None:
    self._run.finish()


class RunLog:
  """Sends metrics to the configured loggers; prints progress and evaluation samples."""

  def __init__(self, workdir: str, total_steps: int, start_step: int = 0,
               loggers: str = "jsonl,tensorboard", config: dict | None = None):
    self.enabled = jax.process_index() == 0
    self.workdir = workdir
    self.total_steps = total_steps
    self._start_time = time.time()
    self._start_step = start_step
    self._loggers = []
    if self.enabled:
      os.makedirs(workdir, exist_ok=True)
      if config is not None:
        with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
          json.dump(config, f, indent=2, sort_keys=True, default=str)
      self._loggers = [LOGGERS.get(name)(workdir, config) for name in parse_loggers(loggers)]

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    clean = {k: _to_float(v) for k, v in metrics.items()}
    for logger in self._loggers:
      logger.write(step, clean)

  def progress(self, step: int, metrics: dict, eta_s: float | None = None) -> None:
    """One console line: step, ETA (`eta_s` where the caller knows it better than the
    pace to `total_steps` does: a budget's end) and the headline metrics."""
    if not self.enabled:
      return
    done = step - self._start_step
    elapsed = time.time() - self._start_time
    if eta_s is not None:
      eta = hms(eta_s)
    else:
      eta = hms(elapsed / done * (self.total_steps - step)) if done > 0 else "?"
    parts = [f"{label}={_to_float(metrics[k]):.4g}" for k, label in PROGRESS if k in metrics]
    print(f"step {step}/{self.total_steps} [{hms(elapsed)}<{eta}] " + " ".join(parts),
          flush=True)

  def eval_samples(self, step: int, responses: list[dict]) -> None:
    """Appends graded completions to `eval_samples.jsonl` and prints them, one line each."""
    if not self.enabled or not responses:
      return
    with open(os.path.join(self.workdir, "eval_samples.jsonl"), "a", encoding="utf-8") as f:
      f.writelines(json.dumps({"step": step, **r}) + "\n" for r in responses)
    for r in responses:
      print(f"  eval sample (step {step}, reward {r['reward']:g}, answer "
            f"{r['ground_truth']}): {r['problem'][:60]!r} -> {r['response'][:80]!r}",
            flush=True)

  def close(self) -> None:
    for logger in self._loggers:
      logger.close()
    self._loggers = []


def _to_float(v):
  if v is None:
    return None
  return float(np.asarray(v))


def hms(seconds: float) -> str:
  seconds = int(seconds)
  return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def truncate(workdir: str, restored_step: int, evaluates_at_start: bool = False) -> None:
  """Drops the rows of `<workdir>/metrics.jsonl` and `eval_samples.jsonl` that a resumed
  run logs again: those past `restored_step` (the checkpoint it resumes from), which a
  killed or stopped run logged but never checkpointed, and step 0's evaluation where no
  checkpoint was complete and the run `evaluates_at_start` again. Only process 0 writes."""
  if jax.process_index() != 0:
    return
  first_step = 0 if restored_step == 0 and evaluates_at_start else restored_step + 1
  for name in ("metrics.jsonl", "eval_samples.jsonl"):
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
      continue
    with open(path, encoding="utf-8") as f:
      lines = f.readlines()
    kept = [line for line in lines if _step(line) < first_step]
    if len(kept) < len(lines):
      with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(kept)
      os.replace(path + ".tmp", path)


def _step(line: str) -> float:
  """A row's step; a line cut short by a kill counts as past every step (dropped)."""
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError):
    return math.inf


def read_metrics(workdir: str) -> list[dict]:
  """All rows of `<workdir>/metrics.jsonl` (for plots and tests)."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
