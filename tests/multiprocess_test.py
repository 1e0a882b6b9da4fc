"""Two JAX processes on one machine train configs/tiny.py, checkpoint and resume.

Each process has 2 fake CPU devices and joins the other over loopback
(`jax.distributed`), so the 4-device mesh spans both processes: params, optimizer state,
rollouts and batches are split across them. Rewards come from `test_even_length` (a
deterministic mixed reward), so the replay buffer fills and retires questions. Each
process prints a digest of its host state (buffer, data stream, counters) at every
checkpoint; the test asserts they are equal, that one process wrote the metrics, that
the resumed run continues the step count, and that the checkpoint exports on one device.
"""

import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from exgrpo_jax.training import run_log

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _train_two_processes(workdir, steps: int) -> list[str]:
  """Runs `python -m exgrpo_jax.train` as processes 0 and 1; returns their stderr."""
  port = _free_port()
  procs = []
  for pid in range(2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "exgrpo_jax.train", "--config=configs/tiny.py",
         f"--workdir={workdir}", f"--config.train.steps={steps}",
         "--config.train.checkpoint_every=1", "--config.reward.plugins=tests.reward_plugins",
         "--config.reward.name=test_even_length"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  outputs = []
  for proc in procs:
    try:
      out, err = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      raise
    assert proc.returncode == 0, f"process failed:\n{out}\n{err[-4000:]}"
    outputs.append(err)
  return outputs


def _digests(stderr: str) -> dict[int, str]:
  return {int(step): d for d, step in
          re.findall(r"host state digest ([0-9a-f]{64}) at step (\d+)", stderr)}


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_resume(tmp_path):
  first = _train_two_processes(tmp_path, steps=2)
  for err in first:
    assert "process" in err and "of 4 devices" in err
  assert _digests(first[0]) == _digests(first[1])
  assert sorted(_digests(first[0])) == [1, 2]

  second = _train_two_processes(tmp_path, steps=4)  # resumes from step 2
  for err in second:
    assert "resumed from" in err
  assert _digests(second[0]) == _digests(second[1])
  assert sorted(_digests(second[0])) == [3, 4]

  rows = run_log.read_metrics(str(tmp_path))
  assert [r["step"] for r in rows] == [1, 2, 3, 4]  # written by process 0 only
  assert rows[-1]["experience/trajectories"] > 0     # the buffer really holds data
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "4"]

  # The sharded, two-host checkpoint exports from this one-device process.
  from exgrpo_jax import convert  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import models  # pylint: disable=g-import-not-at-top
  assert convert.main(["--src", str(tmp_path), "--dst", str(tmp_path / "exported")]) == 0
  exported = models.from_pretrained(str(tmp_path / "exported"))
  assert (exported.config.num_layers, exported.config.hidden_size) == (2, 64)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(exported.params))
