"""The study runner (`python -m exgrpo_jax.study`, exgrpo_jax/study) with evidence v3's
config: the pre-registered stage, health and verdict rules on synthetic runs, the run
summary on a synthetic metrics.jsonl, the committed report reproduced from the committed
summaries, a smoke study from the README's command, and its bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from exgrpo_jax.study import protocol
from exgrpo_jax.study import report as study_report
from exgrpo_jax.study import runs as study_runs
from tests import conftest

pytest.importorskip("scipy")

CONFIG = protocol.load(os.path.join(conftest.REPO_ROOT, "configs", "study_v3.py"))
COMMITTED = os.path.join(conftest.REPO_ROOT, "docs", "results", "study_v3_runs")


def plan(out, exploratory=False):
  return protocol.plan(CONFIG, protocol.read_summaries(out), exploratory)


def report(out):
  return study_report.report(CONFIG, protocol.read_summaries(out))


def cli(*args, cwd=conftest.REPO_ROOT, timeout=600):
  return subprocess.run([sys.executable, "-m", "exgrpo_jax.study", *args], cwd=cwd,
                        env=conftest.subprocess_env(), capture_output=True, text=True,
                        timeout=timeout, check=False)


def fake_run(out, arm, seed, auc, start=0.2, buffered=8, replayed=1, zero=0.5):
  """A run summary whose avg@2 is `auc` at every step from 10 (so its AUC is `auc`)."""
  evals = {str(s): {"avg@2": auc, "greedy": auc} for s in CONFIG.eval_steps}
  if arm.startswith("onpolicy"):
    evals["0"] = {"avg@2": start, "greedy": start}
  run = {"arm": arm, "seed": seed, "commits": ["abc"], "evals": evals,
         "health": {"buffered_at_10": buffered, "replay_share_11_40": replayed / buffered,
                    "replay_solve_all": 0.0},
         "zero_advantage_share": zero,
         "curves": {name: [0.0] * 40 for name in (
             "fresh_solved", "entropy", "length", "on_ratio_max", "off_ratio_max",
             "grad_norm", "buffered", "replayed", "retired", "solve_none", "solve_all",
             "step_s")}}
  with open(os.path.join(out, f"{arm}_s{seed}.json"), "w", encoding="utf-8") as f:
    json.dump(run, f)


def stage1(out, diffs, start=0.2, **exgrpo):
  for seed, d in zip(CONFIG.stages[0], diffs):
    fake_run(out, "onpolicy", seed, 0.4, start=start)
    fake_run(out, "exgrpo", seed, 0.4 + d, **exgrpo)
    fake_run(out, "noreplay", seed, 0.4)
    fake_run(out, "delayed", seed, 0.4)


def test_stage_one_runs_every_arm_seed_by_seed(tmp_path):
  todo, state = plan(str(tmp_path))
  assert state == "stage 1"
  assert todo[:5] == [("onpolicy", 1), ("exgrpo", 1), ("noreplay", 1), ("delayed", 1),
                      ("onpolicy", 2)]
  assert len(todo) == 16
  fake_run(str(tmp_path), "onpolicy", 1, 0.4)
  assert plan(str(tmp_path))[0][0] == ("exgrpo", 1)


def test_a_noisy_stage_one_stops_the_study(tmp_path):
  stage1(str(tmp_path), [0.3, -0.2, 0.1, -0.1])  # SD 22 points
  todo, state = plan(str(tmp_path), exploratory=True)
  assert todo == [] and state.startswith("stopped after stage 1: paired AUC SD 22.2")
  rules = report(str(tmp_path))["rules"]
  assert rules["verdict"].startswith("not resolvable at this budget: paired SD 22.2")


def test_a_quiet_stage_one_goes_on_to_seeds_5_to_8_then_exploratory(tmp_path):
  out = str(tmp_path)
  stage1(out, [0.05, 0.06, 0.04, 0.05])
  todo, state = plan(out)
  assert state == "stage 2" and todo == [(arm, s) for s in (5, 6, 7, 8)
                                         for arm in ("onpolicy", "exgrpo")]
  for seed in (5, 6, 7, 8):
    fake_run(out, "onpolicy", seed, 0.4)
    fake_run(out, "exgrpo", seed, 0.45)
  assert plan(out) == (
      [], "done: 8 of 8 ExGRPO runs healthy (pairs exgrpo - onpolicy)")
  assert plan(out, exploratory=True)[0] == [("rho50", s) for s in (1, 2, 3, 4)]


def test_unhealthy_replay_reruns_both_arms_at_rho_0125_with_8_questions(tmp_path):
  out = str(tmp_path)
  stage1(out, [0.05, 0.06, 0.04, 0.05], buffered=3)  # too few buffered at step 10
  for seed in (5, 6, 7, 8):
    fake_run(out, "onpolicy", seed, 0.4)
    fake_run(out, "exgrpo", seed, 0.45, buffered=3)
  todo, state = plan(out)
  assert state == "fallback stage 1 (0 of 8 ExGRPO runs healthy)"
  assert todo[:2] == [("onpolicy_b8", 1), ("exgrpo_b8", 1)]
  assert protocol.arms(CONFIG)["exgrpo_b8"] == ("exgrpo", ("algo.rho=0.125",
                                                            "train.batch_questions=8"))


@pytest.mark.parametrize("diff, zero, verdict", [
    (0.05, 0.3, "support"),            # d > 0, p < 0.05, healthy, fewer zero-adv groups
    (0.10, 0.6, "inconclusive"),       # the mechanism's figure does not follow
    (-0.02, 0.3, "no rescue-sized effect"),
])
def test_the_verdict_follows_the_written_rules(tmp_path, diff, zero, verdict):
  out = str(tmp_path)
  jitter = [0.01, -0.01, 0.005, -0.005, 0.0, 0.01, -0.01, 0.0]
  stage1(out, [diff + j for j in jitter[:4]], zero=zero)
  for seed, j in zip((5, 6, 7, 8), jitter[4:]):
    fake_run(out, "onpolicy", seed, 0.4)
    fake_run(out, "exgrpo", seed, 0.4 + diff + j, zero=zero)
  result = report(out)
  assert result["rules"]["verdict"].startswith(verdict)
  assert result["primary"]["n"] == 8
  np.testing.assert_allclose(result["primary"]["mean"], diff + np.mean(jitter))
  assert len(result["attribution"]) == 4  # noreplay, delayed x both primary arms
  assert result["rules"]["manipulation_check"]  # 0.4 against 0.2 at step 0


def test_no_arm_learning_is_too_hard(tmp_path):
  # Every arm ends where the untrained model started (avg@2 0.39 at step 0).
  stage1(str(tmp_path), [0.0, 0.01, -0.01, 0.0], start=0.39)
  verdict = report(str(tmp_path))["rules"]["verdict"]
  assert verdict.startswith("too hard at this budget")


def test_run_summary_reads_evaluations_health_and_curves(tmp_path):
  wd = str(tmp_path)
  rows = [{"step": 0, "val/avg_score": 0.2, "val/greedy_score": 0.25}]
  for step in range(1, 41):
    row = {"step": step, "batch/solve_all": 0.25, "batch/solve_none": 0.5,
           "batch/fresh_solved": 0.1, "experience/questions": step,
           "experience/batch_size": 1 if step > 1 else 0,
           "experience/replay_solve_all": 1.0 if step % 2 else 0.0}
    if step % 10 == 0:
      row.update({"val/avg_score": 0.3, "val/greedy_score": 0.35})
    rows.append(row)
  rows.append(dict(rows[5]))  # a resumed run logs step 5 again: counted once
  with open(os.path.join(wd, "metrics.jsonl"), "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  with open(os.path.join(wd, "commits.txt"), "w", encoding="utf-8") as f:
    f.write("abc\nabc\ndef+dirty\n")
  samples = [{"step": step, "problem": f"What is {i} + 1?", "ground_truth": str(i + 1),
              "response": f"{i} + 1 = {i + 1}", "reward": float(i % 2)}
             for step in (30, 40) for i in range(120)]
  with open(os.path.join(wd, "eval_samples.jsonl"), "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in samples)
  run = study_runs.summarize_run(CONFIG, wd, "exgrpo", 3)
  assert run["commits"] == ["abc", "def+dirty"]
  assert run["evals"]["0"] == {"avg@2": 0.2, "greedy": 0.25} and len(run["evals"]) == 5
  assert protocol.auc(run, CONFIG.eval_steps) == pytest.approx(0.3)
  assert run["health"]["buffered_at_10"] == 10
  np.testing.assert_allclose(run["health"]["replay_share_11_40"],
                             np.mean([1 / s for s in range(11, 41)]))
  # Steps 2-40 replay; the odd ones (3, 5, ..., 39) solved their replay groups K/K.
  np.testing.assert_allclose(run["health"]["replay_solve_all"], 19 / 39)
  assert run["zero_advantage_share"] == 0.75
  assert len(run["curves"]["entropy"]) == 40
  assert len(run["correct_at_40"]) == 50
  assert run["correct_at_40"][0] == {"problem": "What is 1 + 1?", "ground_truth": "2",
                                     "response": "1 + 1 = 2"}


def test_the_report_writes_its_json_and_figures(tmp_path):
  out = tmp_path / "study"
  (out / "summaries").mkdir(parents=True)
  stage1(str(out / "summaries"), [0.05, 0.06, 0.04, 0.05])
  proc = cli("report", "--config=configs/study_v3.py", f"--out={out}")
  assert proc.returncode == 0, proc.stderr
  with open(out / "study_v3.json", encoding="utf-8") as f:
    result = json.load(f)
  assert result["rules"]["verdict"] == "pending: 4 of 8 pairs"
  assert len(result["runs"]) == 16 and result["primary"]["n"] == 4
  assert sorted(result["arms"]) == ["delayed", "exgrpo", "noreplay", "onpolicy"]
  onpolicy = result["arms"]["onpolicy"]
  assert onpolicy["collapses"] == 0 and onpolicy["auc"] == pytest.approx(0.4)
  assert set(onpolicy["entropy"]) == {"10", "20", "30", "40"}
  assert sorted(os.listdir(out)) == ["study_v3.json", "study_v3_accuracy.png",
                                     "study_v3_dynamics.png", "study_v3_paired.png",
                                     "summaries"]


def test_a_collapse_is_greedy_accuracy_down_5_points_from_step_0(tmp_path):
  fake_run(str(tmp_path), "onpolicy", 1, 0.40, start=0.46)  # down 6 points
  fake_run(str(tmp_path), "onpolicy", 2, 0.40, start=0.44)  # down 4 points
  runs = study_report.by_arm(CONFIG, protocol.read_summaries(str(tmp_path)))
  assert study_report.arm_summary(CONFIG, runs["onpolicy"])["collapses"] == 1


def test_the_committed_report_is_reproduced_from_the_committed_summaries(tmp_path):
  """docs/results.md's command, pointed at the committed summaries: the same JSON, byte
  for byte, and the committed figures' names."""
  proc = cli("report", "--config=configs/study_v3.py", f"--summaries={COMMITTED}",
             f"--out={tmp_path}")
  assert proc.returncode == 0, proc.stderr
  with open(tmp_path / "study_v3.json", encoding="utf-8") as f, open(
      os.path.join(conftest.REPO_ROOT, "docs", "results", "study_v3.json"),
      encoding="utf-8") as g:
    assert f.read() == g.read()
  assert sorted(os.listdir(tmp_path)) == ["study_v3.json", "study_v3_accuracy.png",
                                          "study_v3_dynamics.png", "study_v3_paired.png"]


@pytest.mark.slow  # two real runs; by default the runner's tests take fake_run's summaries
def test_smoke_study_from_the_readme_command_runs_resumes_and_reports(tmp_path):
  """The README's command with --smoke into a new directory, from the repository as a
  clone has it: both runs of seed 1 train and leave a summary (no checkpoints), status
  and report read them, and a rerun trains nothing."""
  out = str(tmp_path / "study")
  proc = cli("run", "--config=configs/study_v3.py", f"--out={out}", "--smoke")
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert lines[0] == "[study] stage 1: 2 run(s) to go"
  assert lines[1] == f"[study] onpolicy seed 1: {out}/onpolicy_s1/train.log"
  assert "[study] done: 0 of 1 ExGRPO runs healthy (pairs exgrpo - onpolicy): 0 run(s) " \
         "to go" in lines
  assert sorted(os.listdir(os.path.join(out, "summaries"))) == ["exgrpo_s1.json",
                                                                 "onpolicy_s1.json"]
  for arm in ("onpolicy", "exgrpo"):
    assert not os.path.exists(os.path.join(out, f"{arm}_s1", "checkpoints"))
    summary = protocol.read_summary(os.path.join(out, "summaries", f"{arm}_s1.json"))
    assert set(summary["evals"]) == ({"0", "1", "2"} if arm == "onpolicy" else {"1", "2"})
    assert len(summary["curves"]["entropy"]) == 2
  proc = cli("status", "--config=configs/study_v3.py", f"--out={out}", "--smoke")
  assert proc.stdout.splitlines() == [
      "finished (2): exgrpo_s1 onpolicy_s1",
      "done: 0 of 1 ExGRPO runs healthy (pairs exgrpo - onpolicy); next: -"]
  proc = cli("report", "--config=configs/study_v3.py", f"--out={out}", "--smoke")
  assert proc.returncode == 0, proc.stderr
  with open(os.path.join(out, "study_v3.json"), encoding="utf-8") as f:
    result = json.load(f)
  assert result["primary"]["n"] == 1 and result["config"] == "configs/tiny.py"
  proc = cli("run", "--config=configs/study_v3.py", f"--out={out}", "--smoke")
  assert proc.returncode == 0 and "onpolicy seed" not in proc.stdout, proc.stdout


def _damaged(tmp_path):
  out = tmp_path / "study"
  (out / "summaries").mkdir(parents=True)
  stage1(str(out / "summaries"), [0.05, 0.06, 0.04, 0.05])
  path = out / "summaries" / "exgrpo_s2.json"
  text = path.read_text(encoding="utf-8")
  path.write_text(text[:len(text) // 2], encoding="utf-8")
  return out, path


@pytest.mark.parametrize("command", ["status", "report"])
def test_a_summary_cut_in_half_is_named_in_one_line(tmp_path, command):
  out, path = _damaged(tmp_path)
  before = sorted(os.listdir(out))
  proc = cli(command, "--config=configs/study_v3.py", f"--out={out}")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  line, = proc.stderr.strip().splitlines()
  assert line.startswith(f"exgrpo_jax.study: {path}: damaged run summary (")
  assert sorted(os.listdir(out)) == before


def test_a_missing_interpreter_is_refused_before_anything_is_written(tmp_path):
  out = tmp_path / "study"
  proc = cli("run", "--config=configs/study_v3.py", f"--out={out}", "--python",
             str(tmp_path / "no_python"))
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
      f"exgrpo_jax.study: --python {tmp_path / 'no_python'}: no such interpreter"]
  assert not out.exists()


def test_the_committed_results_are_never_a_run_directory(tmp_path):
  """`run --out` at the committed summaries is refused: they are not its own runs."""
  before = sorted(os.listdir(COMMITTED))
  config = os.path.join(conftest.REPO_ROOT, "configs", "study_v3.py")
  proc = cli("run", f"--config={config}", f"--out={COMMITTED}", cwd=tmp_path)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.startswith(f"exgrpo_jax.study: --out {COMMITTED}: inside the committed")
  assert sorted(os.listdir(COMMITTED)) == before


@pytest.mark.slow
def test_sigterm_to_the_runner_stops_the_run_checkpointed_and_a_rerun_resumes(tmp_path):
  """SIGTERM to the runner alone is passed on to its run, which checkpoints and exits 75
  (the runner too, with one line saying to rerun); the same command then finishes the
  study, each step logged once."""
  out = str(tmp_path / "study")
  args = [sys.executable, "-m", "exgrpo_jax.study", "run", "--config=configs/study_v3.py",
          f"--out={out}", "--smoke"]
  metrics = os.path.join(out, "onpolicy_s1", "metrics.jsonl")
  with subprocess.Popen(args, cwd=conftest.REPO_ROOT, env=conftest.subprocess_env(),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
    while proc.poll() is None:
      if os.path.exists(metrics) and os.path.getsize(metrics):  # step 0's evaluation
        proc.send_signal(signal.SIGTERM)
        break
      time.sleep(0.2)
    stdout, stderr = proc.communicate(timeout=600)
  assert proc.returncode == 75, stdout + stderr[-3000:]
  assert stderr.strip().splitlines()[-1] == ("[study] onpolicy seed 1 stopped (exit 75); run "
                                             "the same command again to resume")
  proc = cli("run", "--config=configs/study_v3.py", f"--out={out}", "--smoke")
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  with open(metrics, encoding="utf-8") as f:
    steps = [json.loads(line)["step"] for line in f if line.strip()]
  assert steps == [0, 1, 2]
  assert sorted(os.listdir(os.path.join(out, "summaries"))) == ["exgrpo_s1.json",
                                                                 "onpolicy_s1.json"]


def test_the_lora_study_runs_the_lora_arm_then_the_exploratory_one(tmp_path):
  lora = protocol.load(os.path.join(conftest.REPO_ROOT, "configs", "study_lora.py"))
  for seed in (1, 2, 3, 4):
    name = f"onpolicy_s{seed}.json"
    with open(os.path.join(COMMITTED, name), encoding="utf-8") as f:
      (tmp_path / name).write_text(f.read())
  todo, state = protocol.plan(lora, protocol.read_summaries(str(tmp_path)), False)
  assert (todo, state) == ([("lora", s) for s in (1, 2, 3, 4)], "stage 1")
  cmd = study_runs.command(lora, str(tmp_path), "lora", 1, sys.executable)
  assert cmd[4:] == ["--config.train.seed=1", f"--workdir={tmp_path}/lora_s1",
                     "--config.model.lora.rank=8", "--config.model.lora.alpha=16.0",
                     "--config.optim.lr=1e-4", "--config.eval.before_train=True"]
  assert cmd[3].endswith("configs/smollm2_study_v3.py:onpolicy")
  # With --exploratory, once the LoRA runs are done: ExGRPO with the same adapters.
  for seed in (1, 2, 3, 4):
    shutil.copy(os.path.join(conftest.REPO_ROOT, "docs", "results", "study_lora_runs",
                             f"lora_s{seed}.json"), tmp_path)
  todo, state = protocol.plan(lora, protocol.read_summaries(str(tmp_path)), True)
  assert (todo, state) == ([("exgrpo_lora", s) for s in (1, 2, 3, 4)],
                           "exploratory exgrpo_lora")
  cmd = study_runs.command(lora, str(tmp_path), "exgrpo_lora", 1, sys.executable)
  assert cmd[3].endswith("configs/smollm2_study_v3.py:exgrpo") and cmd[6:9] == [
      "--config.model.lora.rank=8", "--config.model.lora.alpha=16.0", "--config.optim.lr=1e-4"]


def _reproduce(tmp_path, name: str, files) -> dict:
  """The report of configs/<name>.py over `files` (copied into a summaries directory),
  which must equal docs/results/<name>.json byte for byte; that report."""
  summaries = tmp_path / "summaries"
  summaries.mkdir()
  for path in files:
    shutil.copy(path, summaries)
  proc = cli("report", f"--config=configs/{name}.py", f"--out={tmp_path}")
  assert proc.returncode == 0, proc.stderr
  with open(tmp_path / f"{name}.json", encoding="utf-8") as f, open(
      os.path.join(conftest.REPO_ROOT, "docs", "results", f"{name}.json"),
      encoding="utf-8") as g:
    written = f.read()
    assert written == g.read()
  return json.loads(written)


def test_the_committed_lora_report_is_reproduced_from_the_committed_summaries(tmp_path):
  """docs/lora.md's report command: the LoRA runs' summaries (on-policy and the
  exploratory ExGRPO arm) beside study v3's full fine-tuning on-policy ones give the
  committed JSON, byte for byte."""
  runs = os.path.join(conftest.REPO_ROOT, "docs", "results", "study_lora_runs")
  reported = _reproduce(tmp_path, "study_lora", [
      os.path.join(folder, f"{arm}_s{seed}.json") for seed in (1, 2, 3, 4)
      for folder, arm in ((COMMITTED, "onpolicy"), (runs, "lora"), (runs, "exgrpo_lora"))])
  # It tests no claim of ExGRPO's: no health check or verdict of study v3's rules.
  assert reported["rules"] is None and reported["primary"]["pair"] == "lora - onpolicy"
  shutil.copytree(tmp_path / "summaries", tmp_path / "study" / "summaries")
  status = cli("status", "--config=configs/study_lora.py", f"--out={tmp_path / 'study'}")
  assert "done (pairs lora - onpolicy); next: -" in status.stdout, status.stdout
  assert [p["pair"] for p in reported["exploratory"]] == ["exgrpo_lora - lora",
                                                        "exgrpo_lora - onpolicy"]


def test_the_committed_recipe_report_is_reproduced_from_the_committed_summaries(tmp_path):
  """docs/lora.md's recipe report: the tuning and confirmation runs' summaries beside
  study v3's full fine-tuning on-policy ones give the committed JSON, byte for byte, and
  the winner the runner chose."""
  runs = os.path.join(conftest.REPO_ROOT, "docs", "results", "study_lora_recipe_runs")
  reported = _reproduce(tmp_path, "study_lora_recipe", [
      *(os.path.join(COMMITTED, f"onpolicy_s{seed}.json") for seed in (1, 2, 5, 6, 7, 8)),
      *(os.path.join(runs, name) for name in sorted(os.listdir(runs)))])
  winner = reported["tuning"]["winner"]
  with open(os.path.join(runs, "tuned_s5.json"), encoding="utf-8") as f:
    assert json.load(f)["overrides"] == list(dict((a, o) for a, _, o in RECIPE.arms)[winner])
  assert reported["primary"]["pair"] == "tuned - onpolicy"
  assert reported["primary"]["seeds"] == [5, 6, 7, 8]
  assert [p["pair"] for p in reported["exploratory"]] == ["tuned_r1 - tuned",
                                                        "tuned_r1 - onpolicy"]
  assert sorted(p.name for p in tmp_path.glob("*.png")) == [
      "study_lora_recipe_accuracy.png", "study_lora_recipe_dynamics.png",
      "study_lora_recipe_paired.png"]


@pytest.mark.parametrize("base, edit, line", [
    ("study_v3", "c.stages = ((-1, 2, 3, 4), (5, 6, 7, 8))",
     "stages[0]: -1 is not a seed (a whole number >= 0: the runs' train.seed)"),
    ("study_v3", "c.stages = (('x',),)",
     "stages[0]: 'x' is not a seed (a whole number >= 0: the runs' train.seed)"),
    ("study_v3", "c.stages = ((1.5,),)",
     "stages[0]: 1.5 is not a seed (a whole number >= 0: the runs' train.seed)"),
    ("study_v3", "c.stages = ()", "stages=(): must list at least one stage of seeds"),
    ("study_v3", "c.stages = ((1, 2), ())", "stages[1]=(): must list at least one seed"),
    ("study_v3", "c.stages = ((1, 2), (2, 3))",
     "stages: seed 2 is in more than one stage (each seed's runs count once)"),
    ("study_v3", "c.primary = ('exgrpo', 'nope')",
     "primary: 'nope' is not an arm (arms: onpolicy, exgrpo, noreplay, delayed, rho50, "
     "onpolicy_b8, exgrpo_b8)"),
    ("study_v3", "c.primary = ('exgrpo',)",
     "primary=('exgrpo',): must be a pair of two arms"),
    ("study_v3", "c.exploratory = ('rho5',)", "exploratory: 'rho5' is not an arm (arms: "
     "onpolicy, exgrpo, noreplay, delayed, rho50, onpolicy_b8, exgrpo_b8)"),
    ("study_lora_recipe", "c.tuning.seeds = (-1, 2)",
     "tuning.seeds: -1 is not a seed (a whole number >= 0: the runs' train.seed)"),
    ("study_lora_recipe", "c.tuning.seeds = ()", "tuning.seeds=(): must list at least one seed"),
    ("study_lora_recipe", "c.tuning.arms = ()",
     "tuning.arms=(): must list at least one candidate arm"),
    ("study_lora_recipe", "c.tuning.tie = -0.1",
     "tuning.tie=-0.1: must be a number >= 0 (an AUC difference)"),
])
@pytest.mark.parametrize("command", ["status", "run"])
def test_a_bad_study_config_is_refused_in_one_line_before_anything(tmp_path, base, edit,
                                                                  line, command):
  """A study config with a seed that is no training seed, an empty stage or an arm that
  is not one: one line naming the key and value, exit 2, no run directory."""
  config = tmp_path / "study.py"
  config.write_text(f"from configs import {base}\n\n\ndef get_config(arg=None):\n"
                    f"  c = {base}.get_config(arg)\n  {edit}\n  return c\n", encoding="utf-8")
  out = tmp_path / "study"
  # `false` for the runs' interpreter: were a run started, it would fail at once.
  extra = ["--python=false"] if command == "run" else []
  proc = cli(command, f"--config={config}", f"--out={out}", *extra)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert proc.stderr.strip().splitlines() == [f"exgrpo_jax.study: --config={config}: {line}"]
  assert proc.stdout == "" and not out.exists()


def test_every_committed_study_config_passes_the_checks():
  for name in ("study_v3", "study_lora", "study_lora_recipe"):
    for smoke in (False, True):
      protocol.load(os.path.join(conftest.REPO_ROOT, "configs", f"{name}.py"), smoke)


def test_a_report_without_runs_of_an_arm_of_the_primary_pair_is_refused(tmp_path):
  """Summaries that hold no run of one primary arm (or no seed with both) have no paired
  result to report: one line naming the directory and the arm, exit 2, nothing written."""
  summaries = tmp_path / "summaries"
  summaries.mkdir()
  fake_run(str(summaries), "exgrpo", 1, 0.45)
  fake_run(str(summaries), "noreplay", 1, 0.4)
  for added, line in [
      (None, "no run of onpolicy, the primary pair's second arm (arms there: exgrpo, "
             "noreplay)"),
      ("onpolicy", "no seed with runs of both exgrpo and onpolicy (exgrpo: 1; onpolicy: 2)")]:
    if added:
      fake_run(str(summaries), added, 2, 0.4)
    proc = cli("report", "--config=configs/study_v3.py", f"--out={tmp_path}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"exgrpo_jax.study: --summaries {summaries}: {line}; nothing to report"]
  assert sorted(os.listdir(tmp_path)) == ["summaries"]


@pytest.mark.parametrize("command, flag", [("run", "--out"), ("report", "--out"),
                                           ("report", "--json")])
def test_an_unwritable_output_is_refused_before_any_work(tmp_path, command, flag):
  """--out (or report's --json) under a regular file: one line naming the flag, exit 2,
  before any run starts or anything is written."""
  summaries = tmp_path / "summaries"
  summaries.mkdir()
  stage1(str(summaries), [0.05, 0.06, 0.04, 0.05])
  (tmp_path / "file").write_text("", encoding="utf-8")
  bad = tmp_path / "file" / "sub"
  args = [f"--out={bad}" if flag == "--out" else f"--out={tmp_path / 'out'}"]
  if command == "run":
    args.append("--python=false")  # were a run started, it would fail at once
  if command == "report":
    args += [f"--summaries={summaries}"] + ([f"--json={bad}"] if flag == "--json" else [])
  before = sorted(str(p) for p in tmp_path.rglob("*"))
  proc = cli(command, "--config=configs/study_v3.py", *args)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert proc.stderr.strip().splitlines() == [
      f"exgrpo_jax.study: {flag} {bad}: cannot write there ({tmp_path / 'file'} is not a "
      "directory)"]
  assert sorted(str(p) for p in tmp_path.rglob("*")) == before


RECIPE = protocol.load(os.path.join(conftest.REPO_ROOT, "configs", "study_lora_recipe.py"))


def _tuned_run(out, arm, seed, auc, start=0.2, greedy_end=None):
  """A run of the recipe study whose avg@2 is `auc` from step 10, with its own step 0."""
  fake_run(out, arm, seed, auc)
  path = os.path.join(out, f"{arm}_s{seed}.json")
  with open(path, encoding="utf-8") as f:
    run = json.load(f)
  run["evals"]["0"] = {"avg@2": start, "greedy": start}
  if greedy_end is not None:
    run["evals"]["40"]["greedy"] = greedy_end
  with open(path, "w", encoding="utf-8") as f:
    json.dump(run, f)


def test_the_recipe_study_tunes_on_seeds_1_and_2_then_confirms_the_winner_on_5_to_8(
    tmp_path):
  out = str(tmp_path)
  for seed in (1, 2, 5, 6, 7, 8):
    fake_run(out, "onpolicy", seed, 0.5)
  todo, state = protocol.plan(RECIPE, protocol.read_summaries(out), False)
  assert state == "tuning" and todo == [(arm, s) for s in (1, 2)
                                        for arm in ("lr1e-4", "lr3e-4", "lr1e-3")]
  # lr1e-3 scores best but collapses on seed 2 (greedy accuracy 10 points below step 0).
  for seed in (1, 2):
    _tuned_run(out, "lr1e-4", seed, 0.40)
    _tuned_run(out, "lr3e-4", seed, 0.46)
    _tuned_run(out, "lr1e-3", seed, 0.55, greedy_end=0.1 if seed == 2 else None)
  runs = protocol.read_summaries(out)
  assert protocol.tuned(RECIPE, runs) == "lr3e-4"  # the collapsed lr1e-3 is never chosen
  todo, state = protocol.plan(RECIPE, runs, False)
  assert (todo, state) == ([("tuned", s) for s in (5, 6, 7, 8)], "stage 1")
  cmd = study_runs.command(protocol.resolve(RECIPE, runs), out, "tuned", 5, sys.executable)
  assert cmd[5:9] == [f"--workdir={out}/tuned_s5", "--config.model.lora.rank=8",
                      "--config.model.lora.alpha=16.0", "--config.optim.lr=3e-4"]
  for seed in (5, 6, 7, 8):
    _tuned_run(out, "tuned", seed, 0.49 + 0.01 * (seed % 2))
  runs = protocol.read_summaries(out)
  assert protocol.plan(RECIPE, runs, False) == (
      [], "done (pairs tuned - onpolicy; tuned = lr3e-4)")
  assert protocol.plan(RECIPE, runs, True)[0] == [("tuned_r1", s) for s in (5, 6, 7, 8)]
  rank1 = study_runs.command(protocol.resolve(RECIPE, runs), out, "tuned_r1", 5,
                             sys.executable)
  assert rank1[5:9] == [f"--workdir={out}/tuned_r1_s5", "--config.model.lora.alpha=16.0",
                        "--config.optim.lr=3e-4", "--config.model.lora.rank=1"]
  reported = study_report.report(protocol.resolve(RECIPE, runs), runs)
  assert reported["tuning"]["winner"] == "lr3e-4"
  assert reported["tuning"]["candidates"]["lr1e-3"]["collapsed"]
  assert reported["tuning"]["candidates"]["lr3e-4"]["vs"]["seeds"] == [1, 2]
  primary = reported["primary"]
  assert primary["pair"] == "tuned - onpolicy" and primary["seeds"] == [5, 6, 7, 8]
  assert set(primary["by_step"]) == {"10", "20", "30", "40"}
  assert primary["by_step"]["10"]["mean"] == pytest.approx(primary["mean"])


def test_a_tie_in_tuning_goes_to_the_smaller_learning_rate(tmp_path):
  out = str(tmp_path)
  for seed in (1, 2):
    fake_run(out, "onpolicy", seed, 0.5)
    _tuned_run(out, "lr1e-4", seed, 0.460)
    _tuned_run(out, "lr3e-4", seed, 0.464)  # 0.4 points above: within the 0.5-point tie
    _tuned_run(out, "lr1e-3", seed, 0.30)
  assert protocol.tuned(RECIPE, protocol.read_summaries(out)) == "lr1e-4"
