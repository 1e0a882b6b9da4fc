"""configs/tiny.py's docstring on replay holds: the command it gives for a buffer that
fills, run for two steps, stores questions at step 1 and replays them at step 2."""

import json
import shlex
import subprocess
import sys

from configs import tiny
from tests import conftest


def _documented_replay_argv() -> list[str]:
  """The docstring's command that sets a reward, its continuation lines joined."""
  text = tiny.__doc__.replace("\\\n", " ")
  [line] = [line for line in text.splitlines() if "--config.reward.name=" in line]
  return shlex.split(line)


def test_the_documented_replay_command_fills_and_replays_the_buffer(tmp_path):
  argv = _documented_replay_argv()
  assert argv[:3] == ["python", "-m", "exgrpo_jax.train"]
  argv = [sys.executable] + [f"--workdir={tmp_path}" if a.startswith("--workdir=") else a
                             for a in argv[1:]] + ["--config.train.steps=2"]
  result = subprocess.run(argv, cwd=conftest.REPO_ROOT, capture_output=True, text=True,
                          timeout=600, env=conftest.subprocess_env(JAX_PLATFORMS="cpu"))
  assert result.returncode == 0, result.stderr[-2000:]
  with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
    steps = [json.loads(line) for line in f]
  assert [s["step"] for s in steps] == [1, 2]
  assert steps[0]["experience/questions"] > 0  # stored at step 1
  assert steps[1]["experience/batch_size"] > 0  # replayed at step 2
