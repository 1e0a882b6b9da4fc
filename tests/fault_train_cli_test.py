"""Bad input to `python -m exgrpo_jax.train`: bad flags, config keys and values, and
resumes that change what the checkpoint fixes. Each ends in one line naming the flag or
key, with exit status 2, before any training; a resume that changes what the run
computes goes on with one warning line per key.

Real processes on configs/tiny.py (and configs/smollm2_135m.py, whose config is checked
before its model is loaded); the resume cases share one trained 2-step workdir.
"""

import json
import os
import subprocess
import sys

import pytest

from exgrpo_jax import cli
from tests import conftest

REPO = conftest.REPO_ROOT


def _train(*args, config="configs/tiny.py") -> subprocess.CompletedProcess:
  cmd = [sys.executable, "-m", "exgrpo_jax.train", *([f"--config={config}"] if config else []),
         *args]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False,
                        env=conftest.subprocess_env(), timeout=600)


def _refused(proc, line: str) -> None:
  """Exit status 2 and `line` the last of at most two stderr lines (the data line may
  come first), without a traceback."""
  err = [l for l in proc.stderr.splitlines() if l.strip()]
  assert proc.returncode == cli.EXIT_USAGE, proc.stderr[-3000:]
  assert err[-1] == f"exgrpo_jax.train: {line}", err
  assert len(err) <= 2 and "Traceback" not in proc.stderr, err


@pytest.mark.parametrize("args, line", [
    (["--bogus_flag=1"], "Unknown command line flag 'bogus_flag'"),
    (["--config.train.steps=abc"],
     "flag --config.train.steps=abc: invalid literal for int() with base 10: 'abc'"),
    (["extra"], "unexpected arguments: extra"),
    (["--config=configs/nope.py"], "--config=configs/nope.py: no such file"),
    (["--config=configs/tiny.py:nope"], "--config=configs/tiny.py:nope: config argument "
     "'nope': give one variant; unknown: nope; variants: exgrpo, onpolicy, noreplay, no_qsel, "
     "no_tsel, high_ent, no_shaping, no_is, rho25, rho75"),
], ids=["unknown_flag", "bad_value", "positional", "missing_config", "unknown_variant"])
def test_bad_flags_exit_2_with_one_line(tmp_path, args, line):
  _refused(_train(f"--workdir={tmp_path}", *args), line)
  assert not os.listdir(tmp_path)


def test_print_config_prints_the_resolved_config_and_starts_nothing(tmp_path):
  proc = _train("--print_config", f"--workdir={tmp_path / 'run'}",
                "--config.model.lora.rank=4", "--config.model.lora.targets=('q_proj', 'v_proj')")
  assert proc.returncode == 0, proc.stderr[-3000:]
  printed = json.loads(proc.stdout)
  assert printed["model"]["lora"] == dict(rank=4, alpha=16.0, targets=["q_proj", "v_proj"],
                                          base_quant="none")
  assert printed["train"]["steps"] == 3 and printed["data"]["source"] == "arithmetic"
  assert not os.listdir(tmp_path)  # no workdir, lock or checkpoints


def test_a_run_without_a_workdir_is_refused():
  _refused(_train(), "--workdir is required (or --print_config)")


def test_help_exits_0():
  proc = _train("--helpshort", config=None)
  assert proc.returncode == 0 and "--workdir" in proc.stdout + proc.stderr


@pytest.mark.parametrize("flag, line", [
    ("--config.algo.rhoo=0.3", "--config.algo.rhoo: no such config key; did you mean "
                               "--config.algo.rho?"),
    ("--config.algoo.rho=0.3", "--config.algoo.rho: no such config key; did you mean "
                               "--config.algo.rho?"),
    ("--config.train.batch_question=8", "--config.train.batch_question: no such config key; "
                                        "did you mean --config.train.batch_questions?"),
], ids=["key", "section", "plural"])
def test_config_key_typo_names_the_closest_key(tmp_path, flag, line):
  _refused(_train(f"--workdir={tmp_path}", flag), line)


@pytest.mark.parametrize("flag, line", [
    ("--config.data.train_path=/data/mine.parquet",
     "config.data.train_path='/data/mine.parquet': is read only with data.source='file', "
     "and this config's source is 'arithmetic'; add --config.data.source=file, or drop "
     "the path"),
    ("--config.eval.path=/data/valid.parquet",
     "config.eval.path='/data/valid.parquet': is read only with eval.source='file', and "
     "this config's source is 'arithmetic'; add --config.eval.source=file, or drop the "
     "path"),
], ids=["train_path", "eval_path"])
def test_data_path_without_a_file_source_is_refused(tmp_path, flag, line):
  """configs/smollm2_135m.py trains and evaluates on generated arithmetic: a data path
  alone would be ignored."""
  _refused(_train(f"--workdir={tmp_path}", flag, config="configs/smollm2_135m.py"), line)


@pytest.mark.parametrize("flags, line", [
    (["--config.rollout.kv_headroom=0.5"],
     "config.rollout.kv_headroom=0.5: is read only with a capped pool (rollout.kv_pages "
     "above 0), and this run's pool is uncapped (kv_pages=0); drop it, or add "
     "--config.rollout.kv_pages=PAGES"),
    (["--config.rollout.kv_pages=1", "--config.rollout.max_new_tokens=64"],
     "config.rollout.kv_pages=1: 1 pages per batch shard of the mesh's 1, fewer than one "
     "row at its longest (4 pages of 64 tokens for data.max_prompt_tokens=192 + "
     "rollout.max_new_tokens=64), which could never finish; raise it to at least 4 or "
     "lower those lengths"),
    (["--config.rollout.max_rows=-5"], "config.rollout.max_rows=-5: must be a number in "
                                       "[0, inf]"),
], ids=["headroom_without_pool", "pool_below_one_row", "negative_max_rows"])
def test_rollout_pool_settings_are_refused_before_compiling(tmp_path, flags, line):
  """Refused by the config check: no workdir, lock or empty checkpoints/ left behind."""
  workdir = tmp_path / "new"
  _refused(_train(f"--workdir={workdir}", *flags), line)
  assert not os.path.exists(workdir)


@pytest.mark.parametrize("flag, line", [
    ("--config.train.seed=-1", "config.train.seed=-1: must be a whole number in [0, 2**63)"),
    ("--config.train.export_dir=hf", "config.train.export_dir='hf': cannot write the export "
                                     "there ({workdir}/hf exists and is not a model directory)"),
    ("--config.train.export_dir={tmp}/file/hf", "config.train.export_dir='{tmp}/file/hf': "
     "cannot write the export there ({tmp}/file is not a directory)"),
], ids=["negative_seed", "export_dir_a_file", "export_dir_under_a_file"])
def test_a_bad_seed_or_export_dir_is_refused_before_anything(tmp_path, flag, line):
  """Refused by the checks before the run starts, not after the training (the export)
  or the data loading (the seed): the workdir as it was found."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "hf").write_text("notes", encoding="utf-8")
  (tmp_path / "file").write_text("", encoding="utf-8")
  fill = dict(workdir=workdir, tmp=tmp_path)
  _refused(_train(f"--workdir={workdir}", flag.format(**fill)), line.format(**fill))
  assert os.listdir(workdir) == ["hf"]


def test_batch_larger_than_the_data_is_refused(tmp_path):
  _refused(_train(f"--workdir={tmp_path}", "--config.train.batch_questions=1000"),
           "config.train.batch_questions=1000: more than the 64 training questions of "
           "arithmetic:train (a batch never holds a question twice); lower it, or raise "
           "data.limit")
  assert not os.path.exists(tmp_path / "checkpoints")


def test_a_start_refused_after_the_state_is_created_leaves_nothing_behind(tmp_path):
  # The context check runs once the model is loaded: the lock and checkpoints/ exist by
  # then, and a new workdir with them.
  workdir = tmp_path / "new"
  proc = _train(f"--workdir={workdir}", "--config.rollout.max_new_tokens=9000")
  assert proc.returncode == cli.EXIT_ERROR
  assert "exceeds the model's 8192 positions" in proc.stderr.splitlines()[-1]
  assert not os.path.exists(workdir)
  existing = tmp_path / "existing"
  (existing / "notes").mkdir(parents=True)
  _train(f"--workdir={existing}", "--config.rollout.max_new_tokens=9000")
  assert sorted(os.listdir(existing)) == ["notes"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A workdir with the checkpoint of a finished 2-step tiny run (step 2)."""
  workdir = tmp_path_factory.mktemp("trained")
  proc = _train(f"--workdir={workdir}", "--config.train.steps=2", "--config.train.export_dir=")
  assert proc.returncode == 0, proc.stderr[-3000:]
  return workdir


def test_a_finished_run_leaves_no_lock_file(trained):
  """The lock file names the run's pid; once the run has ended it would name a process
  gone."""
  assert not os.path.exists(trained / "lock")


def _listing(workdir):
  return sorted(os.path.relpath(os.path.join(d, f), workdir)
                for d, _, files in os.walk(workdir) for f in files if f != "lock")


@pytest.mark.parametrize("flag, line", [
    ("--config.train.seed=1", "config.train.seed=1: the checkpoint being resumed was "
                              "trained with 0; resume with that value or start a new workdir"),
    # The restore used to fail on the shapes, report both checkpoints as damaged (60 lines
    # of tracebacks) and ask to move the directory away.
    ("--config.model.arch.hidden_size=128",
     "config.model.arch.hidden_size=128: the checkpoint being resumed was trained with 64; "
     "resume with that value or start a new workdir"),
], ids=["seed", "model_shape"])
def test_resume_that_changes_what_the_checkpoint_fixes_is_refused(trained, flag, line):
  before = _listing(trained)
  _refused(_train(f"--workdir={trained}", "--config.train.steps=2", flag), line)
  assert _listing(trained) == before  # nothing moved aside, nothing written


def test_resume_that_changes_the_algorithm_warns_per_key(trained):
  proc = _train(f"--workdir={trained}", "--config.train.steps=2", "--config.algo.rho=0.25",
                "--config.optim.lr=0.0003", "--config.train.log_every=5")
  assert proc.returncode == 0, proc.stderr[-3000:]
  warnings = [l for l in proc.stderr.splitlines() if "warning" in l]
  assert warnings == [
      "[exgrpo_jax] warning: config.algo.rho=0.25 differs from the checkpoint's 0.5 at "
      "step 2; the resumed run uses the new value",
      "[exgrpo_jax] warning: config.optim.lr=0.0003 differs from the checkpoint's 0.0001 "
      "at step 2; the resumed run uses the new value"]  # log_every: no warning
