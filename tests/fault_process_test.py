"""Kills and faults against real processes (slow): signals to a trainer's process group
while it scores, two trainers on one workdir, a damaged newest checkpoint and a missing
export on rerun, SIGKILL in the middle of a checkpoint and of an export, a full workdir.

Trainers are `python -m exgrpo_jax.train` on configs/tiny.py with the deterministic
`test_(slow_)even_length` rewards (tests/reward_plugins.py), as in kill_resume_test.py,
so a resumed run can be compared with an uninterrupted one value for value.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from exgrpo_jax import checkpointing
from exgrpo_jax import cli
from exgrpo_jax.models import export
from exgrpo_jax.training import run_log
from tests import faults
from tests import kill_resume_test

pytestmark = pytest.mark.slow

REPO = kill_resume_test.REPO
STEPS = 3


def _start(workdir, *extra, reward="test_even_length", env=None) -> subprocess.Popen:
  cmd = [sys.executable, "-m", "exgrpo_jax.train", "--config=configs/tiny.py",
         f"--workdir={workdir}", f"--config.train.steps={STEPS}",
         "--config.train.checkpoint_every=1", f"--config.train.keep_checkpoints={STEPS + 1}",
         "--config.reward.plugins=tests.reward_plugins", f"--config.reward.name={reward}",
         *extra]
  # Its own process group, as a job under a scheduler or a terminal has.
  return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True,
                          env=dict(os.environ, **(env or {})))


def _finish(proc, returncode=0) -> str:
  out, _ = proc.communicate(timeout=900)
  assert proc.returncode == returncode, out[-3000:]
  return out


def _last_line(out: str) -> str:
  return [l for l in out.splitlines() if l.strip()][-1]


def _wait_for(predicate, proc, what: str) -> None:
  deadline = time.time() + 600
  while not predicate():
    if proc is not None and proc.poll() is not None:
      raise AssertionError(f"exited before {what}:\n{proc.stdout.read()[-3000:]}")
    assert time.time() < deadline, f"no {what} within 600 s"
    time.sleep(0.02)


def _has_checkpoint(workdir, step):
  return lambda: os.path.exists(os.path.join(checkpointing.checkpoint_dir(workdir), str(step),
                                             checkpointing.MANIFEST))


def _lines(path) -> int:
  try:
    with open(path, encoding="utf-8") as f:
      return sum(1 for _ in f)
  except FileNotFoundError:
    return 0


def _assert_same_run(workdir, reference):
  rows = run_log.read_metrics(workdir)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "one row per step"
  ref = {r["step"]: r for r in run_log.read_metrics(reference)}
  for row in rows:
    assert row["reward/crashes"] == 0 and row["reward/worker_restarts"] == 0
    for name in kill_resume_test.COMPARED:
      np.testing.assert_allclose(row[name], ref[row["step"]][name], rtol=1e-5, atol=1e-6,
                                 err_msg=f"step {row['step']} {name}")
  _, a, _ = checkpointing.load_policy_for_export(reference)
  _, b, _ = checkpointing.load_policy_for_export(workdir)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=1e-6)


def test_sigterm_and_ctrl_c_to_the_process_group_while_scoring(tmp_path):
  """Both stop after the step being scored, checkpoint it, exit 75; reruns match."""
  reference = str(tmp_path / "reference")
  runs = {}
  for sig in (signal.SIGTERM, signal.SIGINT):
    workdir, log = str(tmp_path / sig.name), str(tmp_path / f"{sig.name}.scoring")
    runs[sig] = (workdir, log, _start(workdir, reward="test_slow_even_length",
                                      env={"EXGRPO_TEST_SCORING_LOG": log}))
  reference_proc = _start(reference, reward="test_slow_even_length")
  for sig, (workdir, log, proc) in runs.items():
    _wait_for(_has_checkpoint(workdir, 1), proc, "checkpoint 1")
    scored = _lines(log)
    _wait_for(lambda: _lines(log) > scored, proc, "scoring of step 2")  # noqa: B023
    os.killpg(proc.pid, sig)
  for sig, (workdir, log, proc) in runs.items():
    out = _finish(proc, cli.EXIT_PREEMPTED)
    assert f"{sig.name}: checkpoint at step 2; exiting" in out, out[-2000:]
    assert "Traceback" not in out
    assert checkpointing.CheckpointStore(workdir).latest_step() == 2
  _finish(reference_proc)
  for sig, (workdir, _, _) in runs.items():
    _finish(_start(workdir, reward="test_slow_even_length"))
    _assert_same_run(workdir, reference)


def test_second_trainer_refused_damaged_checkpoint_and_lost_export(tmp_path):
  workdir = str(tmp_path / "run")
  first = _start(workdir)
  _wait_for(_has_checkpoint(workdir, 1), first, "checkpoint 1")
  # Stopped (alive, holding the lock) until the second has tried: a tiny run may
  # otherwise finish before the second starts, which then resumes instead.
  os.killpg(first.pid, signal.SIGSTOP)
  try:
    second = _start(workdir, "--config.train.seed=1")
    out = _finish(second, 1)
  finally:
    os.killpg(first.pid, signal.SIGCONT)
  assert _last_line(out).startswith(f"exgrpo_jax.train: {os.path.abspath(workdir)} is in use "
                                    f"by pid {first.pid} on {socket.gethostname()}"), out
  _finish(first)
  hf = os.path.join(workdir, "hf")
  assert export.is_complete(hf, {"step": STEPS})
  rows = run_log.read_metrics(workdir)

  # An export killed midway: no hf/, a dead process's temporary directory. Rerun: redone.
  os.rename(hf, os.path.join(workdir, ".hf.tmp-999999999"))
  out = _finish(_start(workdir))
  assert f"exported step {STEPS}" in out
  assert export.is_complete(hf, {"step": STEPS})
  assert not os.path.exists(os.path.join(workdir, ".hf.tmp-999999999"))

  # 64 flipped bytes in the newest checkpoint's params: resume from the one before, one
  # line saying so, and land exactly where the first run did.
  step_dir = os.path.join(checkpointing.checkpoint_dir(workdir), str(STEPS))
  faults.flip_bytes(max((os.path.join(r, f) for r, _, fs in os.walk(os.path.join(
      step_dir, "params")) for f in fs), key=os.path.getsize))
  out = _finish(_start(workdir))
  damaged = [l for l in out.splitlines() if "is damaged" in l]
  assert len(damaged) == 1 and f"falling back to step {STEPS - 1}" in damaged[0], out
  again = run_log.read_metrics(workdir)
  assert [r["step"] for r in again] == list(range(1, STEPS + 1))
  for name in kill_resume_test.COMPARED:
    np.testing.assert_allclose(again[-1][name], rows[-1][name], rtol=1e-5, atol=1e-6)


def test_sigkill_during_the_first_checkpoint_logs_each_step_once_on_rerun(tmp_path):
  """Killed while step 1's checkpoint is written (after step 0's evaluation and step 1's
  rows were logged), the rerun starts from step 0 again: both logs hold each step once."""
  workdir = str(tmp_path / "run")
  flags = ("--config.eval.before_train=True", "--config.eval.source=arithmetic",
           "--config.eval.limit=8", "--config.train.export_dir=")
  proc = _start(workdir, *flags)
  ckpt = checkpointing.checkpoint_dir(workdir)
  _wait_for(lambda: os.path.isdir(ckpt) and os.listdir(ckpt), proc, "checkpoint 1 to begin")
  os.killpg(proc.pid, signal.SIGKILL)
  proc.communicate()
  assert not _has_checkpoint(workdir, 1)(), "the kill came after checkpoint 1 was complete"
  assert [r["step"] for r in run_log.read_metrics(workdir)] == [0, 1]
  samples = os.path.join(workdir, "eval_samples.jsonl")
  logged = _lines(samples)
  _finish(_start(workdir, *flags))
  assert [r["step"] for r in run_log.read_metrics(workdir)] == list(range(STEPS + 1))
  assert 0 < _lines(samples) == logged  # step 0's samples, once


_SAVE_BIG = """
import sys, numpy as np
from exgrpo_jax import checkpointing
store = checkpointing.CheckpointStore(sys.argv[1], keep=3)
small = {"w": np.ones((4, 4), np.float32)}
store.save(1, small, small, {}, {"step": 1})
big = {"w": np.ones((64, 1 << 20), np.float32)}
print("saving", flush=True)
store.save(2, big, big, {}, {"step": 2})
"""

_EXPORT_BIG = """
import sys, numpy as np, jax
from exgrpo_jax import models
from exgrpo_jax.models import export
cfg = models.ModelConfig(vocab_size=int(sys.argv[2]), hidden_size=256, intermediate_size=64,
                         num_layers=1, num_heads=4, num_kv_heads=1, head_dim=64,
                         eos_token_id=(2,))
params = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), models.abstract_params(cfg))
print("exporting", flush=True)
export.save_pretrained(cfg, params, sys.argv[1], info={"step": int(sys.argv[3])})
"""


def _python(code, *args) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigkill_during_a_checkpoint_resumes_from_the_previous(tmp_path):
  proc = _python(_SAVE_BIG, tmp_path)
  assert proc.stdout.readline().strip() == "saving"
  ckpt = checkpointing.checkpoint_dir(str(tmp_path))
  _wait_for(lambda: any(".orbax-checkpoint-tmp" in d for d in os.listdir(ckpt)), proc,
            "the step-2 temporary directory")
  proc.kill()
  proc.wait()
  store = checkpointing.CheckpointStore(str(tmp_path))
  small = {"w": jax.ShapeDtypeStruct((4, 4), np.float32)}
  step, (params, _, _, meta) = store.restore_newest_intact(small, small)
  store.close()
  assert step == 1 and meta["step"] == 1
  np.testing.assert_array_equal(params["w"], np.ones((4, 4), np.float32))


def test_sigkill_during_an_export_keeps_the_previous_and_a_rerun_completes(tmp_path):
  dst = str(tmp_path / "hf")
  _finish(_python(_EXPORT_BIG, dst, 300, 1))
  proc = _python(_EXPORT_BIG, dst, 200_000, 2)
  assert proc.stdout.readline().strip() == "exporting"
  _wait_for(lambda: any(d.startswith(".hf.tmp-") for d in os.listdir(tmp_path)), proc,
            "the export's temporary directory")
  proc.kill()
  proc.wait()
  assert export.is_complete(dst, {"step": 1}) and not export.is_complete(dst, {"step": 2})
  _finish(_python(_EXPORT_BIG, dst, 200_000, 2))
  assert export.is_complete(dst, {"step": 2})
  assert sorted(os.listdir(tmp_path)) == ["hf"]
  with open(os.path.join(dst, "config.json"), encoding="utf-8") as f:
    assert json.load(f)["vocab_size"] == 200_000


def test_full_workdir_is_one_line(tmp_path):
  with faults.small_filesystem(str(tmp_path / "fs"), size="4m") as workdir:
    out = _finish(_start(workdir), 1)
  assert _last_line(out) == (f"exgrpo_jax.train: writing checkpoint {workdir}/checkpoints/1 "
                             "failed: No space left on device (errno 28)"), out
  # No traceback of ours or Orbax's. (TensorStore's writer thread may still print the 5-line
  # "Event loop is closed" traceback of its late callback: C code we cannot silence.)
  assert "exgrpo_jax" not in "".join(l for l in out.splitlines() if l.startswith("  File "))
  assert "orbax" not in out.split("step 1/")[-1].split("exgrpo_jax.train:")[0]
