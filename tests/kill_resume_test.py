"""SIGKILL mid-run, resume, and land exactly where an uninterrupted run lands.

Real processes of `python -m exgrpo_jax.train` on configs/tiny.py with the real JAX
sampler. The tiny random model never solves GSM8K, so the reward is the deterministic
`test_even_length` plugin (tests/reward_plugins.py): groups are mixed and the replay
buffer fills, which puts the buffer, the question stream and the optimizer all on the
resume path. The delayed start (0.55) fires at the end of step 1 (accuracy 0.625), so
the replay flag is on the resume path too: step 1 only retires, later steps store and
replay. Run A trains 4 steps uninterrupted while run B (started alongside) is
killed with SIGKILL as soon as its step-2 checkpoint is on disk (so mid step 3), then
rerun with the same workdir. In the `wall_time` case both checkpoint and export by wall
time only (`train.checkpoint_every_minutes`, `train.export_every_minutes`; minutes so
small that every step is due), as a day's run does by the hour: the killed run leaves
a checkpoint taken by wall time and a complete export, and resumes from the former.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from exgrpo_jax import checkpointing
from exgrpo_jax.models import export
from exgrpo_jax.training import run_log

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
# Everything the step computes; timings and wall-clock fields are left out.
COMPARED = ("batch/solved", "batch/replay_started", "actor/pg_loss", "actor/loss",
            "actor/grad_norm", "actor/pg_clipfrac", "actor/entropy", "experience/batch_size",
            "experience/questions", "experience/trajectories", "experience/retired",
            "response_length/mean")


def _start(workdir: str, *flags: str) -> subprocess.Popen:
  cmd = [sys.executable, "-m", "exgrpo_jax.train", "--config=configs/tiny.py",
         f"--workdir={workdir}", f"--config.train.steps={STEPS}",
         "--config.train.checkpoint_every=1", f"--config.train.keep_checkpoints={STEPS}",
         "--config.reward.plugins=tests.reward_plugins",
         "--config.reward.name=test_even_length", "--config.algo.delayed_start=0.55",
         *flags]
  return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


def _finish(proc: subprocess.Popen) -> None:
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]


def _last_row_per_step(workdir: str) -> dict[int, dict]:
  # A killed run may have logged a step it never checkpointed; the rerun logs it again.
  return {row["step"]: row for row in run_log.read_metrics(workdir)}


def _wait_for_checkpoint(proc: subprocess.Popen, workdir: str, step: int) -> None:
  done = os.path.join(checkpointing.checkpoint_dir(workdir), str(step), "meta")
  deadline = time.time() + 600
  while not os.path.isdir(done):
    if proc.poll() is not None:
      raise AssertionError(f"run exited before checkpoint {step}:\n{proc.stdout.read()[-3000:]}")
    assert time.time() < deadline, "no checkpoint within 600 s"
    time.sleep(0.05)


# The LoRA case is slow (2.5 min on 2 cores): its checkpoint's content, the adapters, is
# what differs, and lora_test covers that in the default suite. The wall-time case is
# slow too: budget_test checkpoints and exports by wall time in the default suite.
WALL_TIME = ("--config.train.checkpoint_every=100",
             "--config.train.checkpoint_every_minutes=1e-9",
             "--config.train.export_every_minutes=1e-9")


@pytest.mark.parametrize("flags", [
    (), pytest.param(("--config.model.lora.rank=4", "--config.optim.lr=1e-3"),
                     marks=pytest.mark.slow),
    pytest.param(WALL_TIME, marks=pytest.mark.slow)], ids=["full", "lora", "wall_time"])
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, flags):
  """Also for a LoRA run, whose checkpoints hold the adapters (compared at the end), and
  for checkpoints and exports taken by wall time."""
  reference, killed = str(tmp_path / "reference"), str(tmp_path / "killed")
  reference_proc, proc = _start(reference, *flags), _start(killed, *flags)
  _wait_for_checkpoint(proc, killed, 2)
  proc.send_signal(signal.SIGKILL)
  proc.communicate()
  assert proc.returncode == -signal.SIGKILL
  _finish(reference_proc)
  survived = checkpointing.CheckpointStore(killed, keep=STEPS)
  assert 2 <= survived.latest_step() < STEPS, "the kill did not land mid-run"
  survived.close()
  if flags == WALL_TIME:
    with open(os.path.join(killed, "config.json"), encoding="utf-8") as f:
      assert json.load(f)["train"]["checkpoint_every"] == 100  # so step 2's was by time
    # Each step's export followed its checkpoint, before the next step.
    with open(os.path.join(killed, "hf", export.EXPORT_INFO), encoding="utf-8") as f:
      assert json.load(f)["step"] >= 1

  _finish(_start(killed, *flags))

  ref_rows, resumed_rows = _last_row_per_step(reference), _last_row_per_step(killed)
  assert sorted(resumed_rows) == list(range(1, STEPS + 1))
  # The start fired after step 1 (nothing stored before it); then the replay path was
  # live: the buffer held trajectories and some were replayed.
  assert ref_rows[1]["experience/stored"] == 0 and ref_rows[STEPS]["batch/replay_started"]
  assert ref_rows[STEPS]["experience/trajectories"] > 0
  assert sum(r["experience/batch_size"] for r in ref_rows.values()) > 0
  for step in range(1, STEPS + 1):
    for name in COMPARED:
      np.testing.assert_allclose(resumed_rows[step][name], ref_rows[step][name], rtol=1e-5,
                                 atol=1e-6, err_msg=f"step {step} {name}")

  _, ref_params, _ = checkpointing.load_policy_for_export(reference)
  _, resumed_params, _ = checkpointing.load_policy_for_export(killed)
  for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(resumed_params)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  with open(os.path.join(killed, "metrics.jsonl"), encoding="utf-8") as f:
    assert all(json.loads(line)["step"] >= 1 for line in f)
