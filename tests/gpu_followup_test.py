"""scripts/gpu_followup.py, the GPU issue's prepared measurements, on CPU: its smoke run
(tiny models, one training step) and its argument errors."""

import json
import os
import subprocess
import sys

import pytest

from tests import conftest

SCRIPT = os.path.join(conftest.REPO_ROOT, "scripts", "gpu_followup.py")


def _run(*args, **kwargs):
  return subprocess.run([sys.executable, SCRIPT, *args], cwd=conftest.REPO_ROOT,
                        env=conftest.subprocess_env(), capture_output=True, text=True,
                        timeout=1800, check=False, **kwargs)


@pytest.mark.parametrize("args, line", [
    (["--out", "x.json", "--budget", "decode=soon"], "--budget decode=soon: give NAME=SECONDS"),
    (["--out", "x.json", "--budget", "learner=60"], "--budget learner=60: give NAME=SECONDS"),
    (["--out", "x.json", "--parts", "decode,tests"],
     "--parts: unknown tests; known: decode, study"),
    ([], "--out is required")])
def test_bad_arguments_get_one_line(args, line, tmp_path):
  proc = subprocess.run([sys.executable, SCRIPT, *args], cwd=tmp_path, capture_output=True,
                        text=True, timeout=60, check=False)
  assert proc.returncode == 2 and line in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_smoke_runs_both_parts_and_a_rerun_skips_what_is_done(tmp_path):
  """Every decode measurement of two flag sets (each its own process) and the study's
  pair, two runs at once, one step each; a rerun measures and trains nothing again."""
  out = str(tmp_path / "followup.json")
  args = ("--smoke", "--out", out, "--jobs", "2", "--workdir", str(tmp_path / "runs"))
  proc = _run(*args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(out, encoding="utf-8") as f:
    first = json.load(f)
  decode = first["decode"]
  assert len(decode) == 2 * 4 * 3  # 2 variants x (2 models x batch 1, 8) x 3 engines
  assert all(row["tokens_per_s"] > 0 and row["hbm_bound_tokens_per_s"] > 0
             for row in decode.values()), decode
  assert first["study"]["runs"] == {"onpolicy_s1": "smoke step done",
                                    "exgrpo_s1": "smoke step done"}
  for arm in ("onpolicy", "exgrpo"):
    with open(tmp_path / "runs" / f"{arm}_s1" / "train.log", encoding="utf-8") as f:
      assert "step 1/1" in f.read()
  proc = _run(*args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(out, encoding="utf-8") as f:
    assert json.load(f) == first  # nothing measured or trained again
