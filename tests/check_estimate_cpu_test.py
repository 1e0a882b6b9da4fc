"""scripts/bench/check_estimate_cpu.py --reprice: the committed CPU checks are what the
estimator gives today from their own compiled programs and recorded steps."""

import glob
import json
import os
import statistics
import subprocess
import sys

import pytest

from tests import conftest

SCRIPT = os.path.join(conftest.REPO_ROOT, "scripts", "bench", "check_estimate_cpu.py")
CHECKS = sorted(glob.glob(os.path.join(conftest.REPO_ROOT, "docs", "results",
                                       "estimate_check_cpu_*.json")))


def _reprice(path, out):
  return subprocess.run([sys.executable, SCRIPT, f"--reprice={path}", f"--out={out}"],
                        cwd=conftest.REPO_ROOT, env=conftest.subprocess_env(),
                        capture_output=True, text=True, timeout=300, check=False)


def _leaves(tree, path=""):
  """{path: leaf} of a JSON tree, numbers as floats, anything else as its text."""
  if isinstance(tree, dict):
    return {k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{path}/{key}").items()}
  if isinstance(tree, list):
    return {k: v for i, sub in enumerate(tree) for k, v in _leaves(sub, f"{path}[{i}]").items()}
  number = isinstance(tree, (int, float)) and not isinstance(tree, bool)
  return {path: float(tree) if number else str(tree)}


@pytest.mark.parametrize("path", CHECKS, ids=os.path.basename)
def test_the_committed_checks_are_priced_as_the_estimator_prices_today(path, tmp_path):
  done = _reprice(path, tmp_path / "again.json")
  assert done.returncode == 0, done.stderr
  with open(path, encoding="utf-8") as f:
    committed = json.load(f)
  with open(tmp_path / "again.json", encoding="utf-8") as f:
    again = json.load(f)
  for key in ("repriced", "repriced_date"):
    committed.pop(key, None), again.pop(key)  # a fresh check was never repriced
  # Python 3.12's sum() of floats is compensated: the last bit may differ from 3.11's.
  again, committed_leaves = _leaves(again), _leaves(committed)
  assert again.keys() == committed_leaves.keys()
  numbers = {k for k, v in committed_leaves.items() if isinstance(v, float)}
  assert {k: again[k] for k in numbers} == pytest.approx(
      {k: committed_leaves[k] for k in numbers}, rel=1e-12)
  assert ({k: v for k, v in again.items() if k not in numbers}
          == {k: v for k, v in committed_leaves.items() if k not in numbers})
  # The CPU's own rule (compute and memory times added) names the costliest phase as
  # measured; the other two, within a fifth of each other, may swap (the GSM8K run's).
  assert committed["report"]["target"]["overlap"] is False
  assert committed["estimated_ranking"][0] == committed["measured_ranking"][0]
  for step in committed["steps"]:
    for phase, seconds in step["estimated_s"].items():
      assert seconds >= step["overlapped_s"][phase]


@pytest.mark.parametrize("path", CHECKS, ids=os.path.basename)
def test_the_cpus_rates_are_the_medians_of_its_readings(path, tmp_path):
  """One reading of seven once came out twice the others (a quiet moment): the roofline
  takes the median reading, not the best, and the JSON keeps every reading."""
  done = _reprice(path, tmp_path / "again.json")
  assert done.returncode == 0, done.stderr
  with open(tmp_path / "again.json", encoding="utf-8") as f:
    again = json.load(f)
  cpu, target = again["cpu"], again["report"]["target"]
  assert len(cpu["measured_gflops_per_s"]) == again["measured_steps"] + again["warmup_steps"] + 1
  assert cpu["matmul_gflops_per_s"] == statistics.median(cpu["measured_gflops_per_s"])
  assert cpu["bandwidth_gb_per_s"] == statistics.median(cpu["measured_gb_per_s"])
  assert target["peak_flops"] == cpu["matmul_gflops_per_s"] * 1e9
  assert target["hbm_bandwidth"] == cpu["bandwidth_gb_per_s"] * 1e9


def test_a_file_it_did_not_write_is_one_line(tmp_path):
  (tmp_path / "other.json").write_text("{}")
  done = _reprice(tmp_path / "other.json", tmp_path / "out.json")
  assert done.returncode == 2
  assert done.stderr.strip().splitlines() == [
      f"check_estimate_cpu: --reprice={tmp_path}/other.json: not a JSON this script wrote "
      "(no report or steps)"]
  assert not (tmp_path / "out.json").exists()
