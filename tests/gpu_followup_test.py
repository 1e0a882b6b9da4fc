"""scripts/accelerator/gpu_followup.py, the GPU issue's prepared measurements, on CPU: its smoke
(tiny models, one training step) and its argument errors."""

import json
import os
import subprocess
import sys

import pytest

from tests import conftest

SCRIPT = os.path.join(conftest.REPO_ROOT, "scripts", "accelerator", "gpu_followup.py")


def _run(*args, **kwargs):
  return subprocess.run([sys.executable, SCRIPT, *args], cwd=conftest.REPO_ROOT,
                        env=conftest.subprocess_env(), capture_output=True, text=True,
                        timeout=1800, check=False, **kwargs)


@pytest.mark.parametrize("args, line", [
    (["--out", "x.json", "--budget", "decode=soon"], "--budget decode=soon: give NAME=SECONDS"),
    (["--out", "x.json", "--budget", "learner=60"], "--budget learner=60: give NAME=SECONDS"),
    (["--out", "x.json", "--parts", "decode,tests"],
     "--parts: unknown tests; known: decode, study"),
    ([], "--out is required"),
    (["--out", "x.json", "--jobs", "0"], "argument --jobs: must be at least 1, got 0")])
def test_bad_arguments_get_one_line(args, line, tmp_path):
  proc = subprocess.run([sys.executable, SCRIPT, *args], cwd=tmp_path, capture_output=True,
                        text=True, timeout=60, check=False)
  assert proc.returncode == 2 and line in proc.stderr.strip().splitlines()[-1]
  assert "Traceback" not in proc.stderr and not os.listdir(tmp_path)  # nothing written


@pytest.mark.parametrize("name, text, line", [
    ("notes.txt", "not JSON\n", "--out notes.txt: not a follow-up report to continue "
                                 "(Expecting value: line 1 column 1 (char 0)); name a new file"),
    ("study_gpu_runs/exgrpo_s1.json", '{"arm": "exgrpo", "se',
     "study_gpu_runs/exgrpo_s1.json: damaged run summary (Unterminated string")])
def test_a_damaged_file_it_would_continue_is_named_in_one_line(tmp_path, name, text, line):
  """--out at a file that is not a follow-up report, or a study summary cut short in the
  directory its study part continues: one line naming the file, exit 2, nothing new."""
  (tmp_path / name).parent.mkdir(exist_ok=True)
  (tmp_path / name).write_text(text, encoding="utf-8")
  before = sorted(str(p) for p in tmp_path.rglob("*"))
  out = "notes.txt" if name == "notes.txt" else "followup.json"
  proc = subprocess.run([sys.executable, SCRIPT, "--out", out, "--parts", "study"],
                        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert line in proc.stderr.strip().splitlines()[-1]
  assert sorted(str(p) for p in tmp_path.rglob("*")) == before


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
