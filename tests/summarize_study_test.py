"""scripts/summarize_study.py: paired differences, the shared step-0 evaluation, budgets."""

import importlib.util
import json
import os

import numpy as np
import pytest

pytest.importorskip("scipy")
_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "summarize_study.py")
_SPEC = importlib.util.spec_from_file_location("summarize_study", _PATH)
summarize_study = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(summarize_study)

GREEDY = {("onpolicy", 1): 0.50, ("onpolicy", 2): 0.40, ("onpolicy", 3): 0.45,
          ("exgrpo", 1): 0.60, ("exgrpo", 2): 0.42, ("exgrpo", 3): 0.55}


def _write_run(study, method, seed, steps=4, last=4):
  workdir = os.path.join(study, f"{method}_s{seed}")
  os.makedirs(workdir)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"train": {"steps": steps, "batch_questions": 4}, "rollout": {"k": 4},
               "eval": {"n": 4, "temperature": 0.6}}, f)
  rows = []
  if method == "onpolicy":
    rows.append({"step": 0, "val/greedy_score": 0.3, "val/avg_score": 0.2})
  for step in range(1, last + 1):
    row = {"step": step, "batch/solved": 0.5, "batch/fresh_solved": 0.5,
           "actor/entropy": 1.0, "response_length/mean": 10.0, "timing_s/step": 2.0}
    if method == "exgrpo" and step > 1:
      row["experience/batch_size"] = 2
    if step == steps:
      row.update({"val/greedy_score": GREEDY[method, seed], "val/avg_score": 0.5})
    rows.append(row)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))


def test_paired_difference_budget_and_unfinished_runs(tmp_path):
  study = str(tmp_path)
  for (method, seed) in GREEDY:
    _write_run(study, method, seed)
  _write_run(study, "no_tsel", 1, last=2)  # interrupted: left out
  result = summarize_study.summarize(study)
  assert set(result["methods"]) == {"onpolicy", "exgrpo"}

  diffs = np.array([GREEDY["exgrpo", s] - GREEDY["onpolicy", s] for s in (1, 2, 3)])
  d = result["paired"]["exgrpo-onpolicy"]["greedy@4"]
  half = 4.302652729911275 * diffs.std(ddof=1) / np.sqrt(3)  # t(0.975, df=2)
  assert d["n"] == 3 and d["favour"] == 3 and d["against"] == 0
  np.testing.assert_allclose(d["mean"], diffs.mean())
  np.testing.assert_allclose(d["ci95"], [diffs.mean() - half, diffs.mean() + half])
  assert "greedy@0" not in result["paired"]["exgrpo-onpolicy"]  # same model: no difference

  # The on-policy run's step-0 evaluation is every method's.
  assert result["methods"]["exgrpo"]["val"]["greedy@0"]["per_seed"] == [0.3] * 3
  # 4 steps of B*K = 16 rollouts, less one per replayed question (3 steps x 2).
  assert result["methods"]["onpolicy"]["rollouts"] == 64
  assert result["methods"]["exgrpo"]["rollouts"] == 64 - 6
  text = summarize_study.tables(result)
  assert "| exgrpo-onpolicy | 3 | greedy@4 | 7.3 |" in text
  assert "| exgrpo | 60.0 / 50.0 | 42.0 / 50.0 | 55.0 / 50.0 |" in text
  paths = summarize_study.plot(result, str(tmp_path / "plots"))
  assert all(os.path.getsize(p) > 0 for p in paths)


def test_runs_shorter_than_three_steps_are_summarised(tmp_path):
  """A smoke study (reproduce_small.sh with FLAGS=--config.train.steps=2): the on-policy
  run's step-0 evaluation row is among its last 3 rows and holds no training metrics."""
  for (method, seed) in GREEDY:
    _write_run(str(tmp_path), method, seed, steps=2, last=2)
  result = summarize_study.summarize(str(tmp_path))
  assert result["methods"]["onpolicy"]["solved_last3"] == 0.5
  assert "| exgrpo-onpolicy | 3 | greedy@2 |" in summarize_study.tables(result)


def test_no_finished_run_is_one_clear_error(tmp_path):
  _write_run(str(tmp_path), "onpolicy", 1, last=1)
  with pytest.raises(SystemExit, match="no finished runs"):
    summarize_study.summarize(str(tmp_path))
