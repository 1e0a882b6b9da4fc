"""Start-up config validation: shipped configs pass; each kind of mistake is one clear line."""

import dataclasses
import importlib
import os
import subprocess
import sys

import pytest

from configs import common
from exgrpo_jax import cli
from exgrpo_jax import config_cli
from exgrpo_jax import models
from exgrpo_jax.sampling import pages
from exgrpo_jax.training import config_check
from exgrpo_jax.training import resume_check
from tests import configs_test

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A question file in the repository, so these tests need no data beside it.
QUESTIONS = os.path.join(REPO, "tests", "data", "questions.jsonl")


def _config(name="tiny", variant="exgrpo"):
  c = importlib.import_module(f"configs.{name}").get_config(variant)
  # Paper configs name data and weights the user supplies; point them at files here.
  c.model.path = ""
  if c.data.source == "file":
    c.data.train_path = QUESTIONS
  if c.eval.source == "file":
    c.eval.path = QUESTIONS
  return c


@pytest.mark.parametrize("name", configs_test.NAMES)
@pytest.mark.parametrize("variant", common.VARIANTS)
def test_shipped_configs_pass(name, variant):
  config_check.check(_config(name, variant))


@pytest.mark.parametrize("key, value, message", [
    ("algo.rho", 1.5, r"config.algo.rho=1.5: must be a number in \[0, 1\]"),
    ("algo.rho", -0.1, r"config.algo.rho=-0.1"),
    ("rollout.k", 1, r"config.rollout.k=1: must be a number in \[2, inf\]"),
    ("rollout.max_new_tokens", -5, r"config.rollout.max_new_tokens=-5: .*\(0, inf\]"),
    ("data.max_prompt_tokens", 0, r"config.data.max_prompt_tokens=0"),
    ("rollout.top_p", 0.0, r"config.rollout.top_p=0.0: .*\(0, 1\]"),
    ("algo.loss", "ppo", r"config.algo.loss='ppo': must be one of exgrpo, grpo"),
    ("algo.advantage", "z", r"config.algo.advantage='z': must be one of group_mean"),
    ("reward.name", "exact", r"config.reward.name='exact': must be one of .*math_verify"),
    ("data.template", "alpaca", r"config.data.template='alpaca'"),
    ("rollout.engine", "sglang", r"config.rollout.engine='sglang': must be one of jax, vllm"),
    ("algo.trajectory_selection", "longest", r"config.algo.trajectory_selection='longest'"),
    ("replay.weighting", "zipf", r"config.replay.weighting='zipf'"),
    ("optim.lr", 0.0, r"config.optim.lr=0.0"),
    ("optim.mini_batches", 64, r"config.optim.mini_batches=64: more than the 16 responses"),
    ("optim.micro_batch_size", 9, r"config.optim.micro_batch_size=9: larger than a "
                                  r"mini-batch \(8 responses"),
    ("train.steps", 0, r"config.train.steps=0"),
    ("data.source", "file", r"config.data.train_path='': is required"),
    ("model.dtype", "float16", r"config.model.dtype='float16': must be one of float32"),
    ("model.remat", "partial", r"config.model.remat='partial': must be one of none, full, dots"),
    ("reward.plugins", "tests.reward_plugins,no_such_module",
     r"config.reward.plugins=.*module 'no_such_module' cannot be imported"),
    ("algo.old_logp_source", "sampler",
     r"config.algo.old_logp_source='sampler': must be one of auto, rollout, recompute"),
    ("replay.bucketing", "reward_mean",
     r"config.replay.bucketing='reward_mean': must be one of correct_count, reward_std"),
    ("replay.sigma", 0.0, r"config.replay.sigma=0.0: must be a number in \(0, inf\]"),
    ("algo.tis_cap", 1.0, r"config.algo.tis_cap=1.0: must be 0 or None \(off\) or a finite "
                          r"number above 1"),
    ("algo.tis_cap", -2.0, r"config.algo.tis_cap=-2.0: must be 0 or None"),
    ("algo.tis_cap", float("inf"), r"config.algo.tis_cap=inf: must be 0 or None"),
    ("algo.tis_cap", float("nan"), r"config.algo.tis_cap=nan: must be 0 or None"),
    ("rollout.kv_pages", -1, r"config.rollout.kv_pages=-1: must be a number in \[0, inf\]"),
    ("rollout.kv_headroom", 1.0, r"config.rollout.kv_headroom=1.0: must be below 1"),
    ("rollout.max_rows", -5, r"config.rollout.max_rows=-5: must be a number in \[0, inf\]"),
])
def test_bad_value_is_one_clear_error(key, value, message):
  c = _config()
  section, name = key.split(".")
  c[section][name] = value
  with pytest.raises(config_check.ConfigError, match=message):
    config_check.check(c)


def test_a_missing_file_names_the_source_key_that_asks_for_it():
  c = _config()
  c.eval.every, c.eval.path = 5, ""
  with pytest.raises(config_check.ConfigError) as e:
    config_check.check(c)
  assert str(e.value) == ("config.eval.path='': is required with eval.source='file' (the "
                          "default): name a data file, or set eval.source to one of "
                          "arithmetic, reasoning_gym")


def test_every_bad_value_gets_its_own_line():
  c = _config()
  c.algo.rho, c.rollout.k, c.optim.mini_batches = 2.0, 1, 0
  c.rollout.engine, c.rollout.vllm.dtype, c.rollout.vllm.max_num_seqs = "vllm", "foo", 0
  with pytest.raises(config_check.ConfigError) as e:
    config_check.check(c)
  lines = str(e.value).splitlines()
  assert [l.split(":")[0] for l in lines] == [
      "config.rollout.k=1", "config.rollout.vllm.max_num_seqs=0",
      "config.rollout.vllm.dtype='foo'", "config.algo.rho=2.0", "config.optim.mini_batches=0"]


def test_a_kv_pool_size_needs_the_continuous_scheduler():
  c = _config()
  c.rollout.kv_pages, c.rollout.scheduler = 40, "static"
  with pytest.raises(config_check.ConfigError, match=r"config.rollout.kv_pages=40: needs "
                                                     r"rollout.scheduler='continuous'"):
    config_check.check(c)
  c.rollout.scheduler = "continuous"
  config_check.check(c)


def test_a_kv_pool_below_one_row_at_its_longest_is_refused():
  """The engine's pages of a row of data.max_prompt_tokens (bucketed) + max_new_tokens."""
  c = _config()
  c.rollout.max_new_tokens = 64
  per_row = pages.pages_per_row(c.data.max_prompt_tokens, 64)
  c.rollout.kv_pages = per_row - 1
  with pytest.raises(config_check.ConfigError) as e:
    config_check.check(c)
  assert str(e.value) == (
      f"config.rollout.kv_pages={per_row - 1}: {per_row - 1} pages per batch shard of the "
      f"mesh's 1, fewer than one row at its longest ({per_row} pages of 64 tokens for "
      f"data.max_prompt_tokens={c.data.max_prompt_tokens} + rollout.max_new_tokens=64), "
      f"which could never finish; raise it to at least {per_row} or lower those lengths")
  c.rollout.kv_pages = per_row
  config_check.check(c)


def test_kv_headroom_without_a_capped_pool_is_refused():
  c = _config()
  c.rollout.kv_headroom = 0.5
  with pytest.raises(config_check.ConfigError) as e:
    config_check.check(c)
  assert str(e.value) == (
      "config.rollout.kv_headroom=0.5: is read only with a capped pool (rollout.kv_pages "
      "above 0), and this run's pool is uncapped (kv_pages=0); drop it, or add "
      "--config.rollout.kv_pages=PAGES")
  c.rollout.kv_pages = 40
  config_check.check(c)


def test_a_generated_sources_settings_without_that_source_are_refused():
  c = _config()
  c.data.source, c.eval.source = "file", "file"
  c.data.arithmetic.max_operand, c.data.reasoning_gym.dataset = 999, "chain_sum"
  with pytest.raises(config_check.ConfigError) as e:
    config_check.check(c)
  assert [l for l in str(e.value).splitlines() if "data.arithmetic" in l
          or "data.reasoning_gym" in l] == [
      "config.data.arithmetic.max_operand=999: is read only with data.source or eval.source "
      "'arithmetic', and this run's sources are 'file' and 'file'; drop it, or add "
      "--config.data.source=arithmetic",
      "config.data.reasoning_gym.dataset='chain_sum': is read only with data.source or "
      "eval.source 'reasoning_gym', and this run's sources are 'file' and 'file'; drop it, "
      "or add --config.data.source=reasoning_gym"]


def test_vllm_settings_with_the_jax_engine_are_refused():
  c = _config()
  c.rollout.vllm.dtype, c.rollout.vllm.sleep_level = "int8", 0
  with pytest.raises(config_check.ConfigError) as e:
    config_check.check(c)
  assert str(e.value).splitlines() == [
      f"config.rollout.vllm.{key}={value!r}: is read only with rollout.engine='vllm', and "
      "this run's engine is 'jax'; drop it, or add --config.rollout.engine=vllm"
      for key, value in (("dtype", "int8"), ("sleep_level", 0))]


def test_jax_sampler_settings_with_the_vllm_engine_are_named_not_refused():
  c = _config("qwen7b")  # plans rollout.max_rows for the JAX engine
  assert config_check.ignored(c) == []
  c.rollout.engine, c.rollout.scheduler = "vllm", "static"
  assert config_check.ignored(c) == [
      "config.rollout.max_rows=1024 sizes the JAX sampler's KV cache; the vllm engine "
      "ignores it (rollout.vllm.max_num_seqs bounds its batch)",
      f"config.rollout.kv_pages={c.rollout.kv_pages} sizes the JAX sampler's KV pool; the "
      "vllm engine ignores it (rollout.vllm.gpu_memory_utilization sizes its own)",
      "config.rollout.scheduler='static' is the JAX sampler's; the vllm engine schedules "
      "its own rows"]


@pytest.mark.parametrize("key, source_key", [("data.train_path", "data.source"),
                                             ("eval.path", "eval.source")])
def test_data_path_without_a_file_source_is_one_clear_error(key, source_key):
  c = _config("smollm2_135m")
  section, name = key.split(".")
  c[section][name] = QUESTIONS
  with pytest.raises(config_check.ConfigError,
                     match=rf"config.{key}='.*questions.jsonl': is read only with "
                           rf"{source_key}='file', and this config's source is 'arithmetic'"):
    config_check.check(c)
  c[source_key.split(".")[0]][source_key.split(".")[1]] = "file"
  config_check.check(c)


def test_missing_data_file_is_one_clear_error():
  c = _config()
  c.data.source, c.data.train_path = "file", "/nonexistent.parquet"
  with pytest.raises(config_check.ConfigError,
                     match=r"config.data.train_path='/nonexistent.parquet': .*no such file"):
    config_check.check(c)


def test_runlocal_is_refused_by_configs_that_already_run_locally():
  with pytest.raises(ValueError, match=r"config argument 'runlocal': give one variant; "
                     r"unknown: runlocal; variants: exgrpo, "):
    importlib.import_module("configs.tiny").get_config("runlocal")


def test_replay_k_override_is_refused():
  c = _config()
  c.replay.k = 3  # replay.k is derived from rollout.k; overriding it must not move K
  assert c.rollout.k == 4
  with pytest.raises(config_check.ConfigError,
                     match=r"config.replay.k=3: must equal rollout.k=4"):
    config_check.check(c)


def test_sigma_none_means_one_over_k():
  c = _config()
  c.replay.sigma = None
  config_check.check(c)


def test_rollout_log_probs_need_temperature_one():
  c = _config()
  c.algo.old_logp_source = "rollout"
  config_check.check(c)
  c.rollout.temperature = 0.7
  with pytest.raises(config_check.ConfigError,
                     match=r"config.algo.old_logp_source='rollout': needs "
                           r"rollout.temperature=1, not 0.7"):
    config_check.check(c)


def test_tis_needs_the_recomputed_old_log_probs():
  c = _config()
  c.algo.tis_cap = 2.0
  config_check.check(c)  # `auto` then recomputes (training/phase.py)
  c.algo.tis_cap = None  # off, as 0 is
  config_check.check(c)
  c.algo.tis_cap = 2.0
  c.algo.old_logp_source = "rollout"
  with pytest.raises(config_check.ConfigError) as e:
    config_check.check(c)
  assert str(e.value) == ("config.algo.tis_cap=2.0: needs the learner's recomputed old "
                          "log-probs; algo.old_logp_source='rollout' has none (use auto or "
                          "recompute)")


@pytest.mark.parametrize("key, value, reason", [
    ("rollout.k", 8, "4"),
    ("model.arch.hidden_size", 128, "64"),
    ("data.limit", 32, "64"),
    ("train.seed", 1, "0"),
])
def test_resume_refuses_what_the_checkpoint_cannot_follow(key, value, reason):
  saved = _config().to_dict()
  c = _config()
  *sections, name = key.split(".")
  node = c
  for section in sections:
    node = node[section]
  node[name] = value
  with pytest.raises(config_check.ConfigError,
                     match=rf"config.{key}={value}: the checkpoint being resumed was "
                           rf"trained with {reason};"):
    resume_check.check(saved, c)


def test_resume_warns_per_changed_algorithm_key_and_not_for_free_ones():
  saved = _config().to_dict()
  c = _config()
  c.replay.sigma, c.optim.lr, c.algo.rho = 0.5, 3e-4, 0.25
  c.train.steps, c.eval.every, c.optim.micro_batch_size = 10, 5, 2  # free
  assert resume_check.check(saved, c, step=4) == [
      f"config.{key}={new} differs from the checkpoint's {old} at step 4; the resumed run "
      "uses the new value" for key, new, old in (
          ("algo.rho", 0.25, 0.5), ("optim.lr", 0.0003, 0.0001), ("replay.sigma", 0.5, 0.25))]


def test_resume_refuses_another_model_under_the_same_key():
  """The file at model.path replaced by another model: the config keys are unchanged."""
  cfg = models.ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
  saved = dataclasses.asdict(dataclasses.replace(cfg, num_layers=3, dtype="bfloat16"))
  c = _config("smollm2_135m")
  c.model.path = "/models/mine"
  resume_check.check_model(dataclasses.asdict(dataclasses.replace(cfg, dtype="bfloat16")),
                           cfg, c)  # the compute dtype follows the run's config
  with pytest.raises(config_check.ConfigError,
                     match=r"config.model.path='/models/mine': the model differs from the one "
                           r"the checkpoint being resumed was trained with \(num_layers 3 -> 2\)"):
    resume_check.check_model(saved, cfg, c)


@pytest.mark.parametrize("key, message", [
    ("algo.rhoo", "--config.algo.rhoo: no such config key; did you mean --config.algo.rho?"),
    ("rho", "--config.rho: no such config key; did you mean --config.algo.rho?"),
    ("algo.rho.x", "--config.algo.rho.x: no such config key; did you mean --config.algo.rho?"),
    ("zzz.qqq", "--config.zzz.qqq: no such config key"),
])
def test_unknown_key_names_the_closest_valid_one(key, message):
  assert config_cli.unknown_key(_config(), key) == message
  assert config_cli.unknown_key(_config(), "rollout.vllm.sleep_level") is None


def test_eval_before_train_is_none_true_or_false():
  c = _config("smollm2_135m")
  assert c.eval.before_train is None and c.eval.every == 8
  c.eval.before_train = True
  config_check.check(c)


@pytest.mark.parametrize("flag, line", [
    ("--config.algo.rho=2.0", "config.algo.rho=2.0: must be a number in [0, 1]"),
    ("--config.replay.k=3", "config.replay.k=3: must equal rollout.k=4 (it is derived "
                            "from it; override rollout.k)"),
])
def test_train_cli_prints_one_line_and_fails(tmp_path, flag, line):
  proc = subprocess.run(
      [sys.executable, "-m", "exgrpo_jax.train", "--config=configs/tiny.py",
       f"--workdir={tmp_path}", flag],
      capture_output=True, text=True, check=False, cwd=REPO)
  assert proc.returncode == cli.EXIT_USAGE
  assert proc.stderr.strip().splitlines()[-1] == f"exgrpo_jax.train: {line}"
  assert "Traceback" not in proc.stderr
  assert not os.path.exists(tmp_path / "checkpoints")


def test_train_cli_lists_every_bad_value_and_debug_keeps_the_status(tmp_path):
  flags = ["--config.rollout.engine=vllm", "--config.rollout.vllm.dtype=foo",
           "--config.rollout.vllm.max_num_seqs=0"]
  run = lambda *extra: subprocess.run(
      [sys.executable, "-m", "exgrpo_jax.train", "--config=configs/tiny.py",
       f"--workdir={tmp_path}", *flags, *extra],
      capture_output=True, text=True, check=False, cwd=REPO)
  proc = run()
  assert proc.returncode == cli.EXIT_USAGE
  assert proc.stderr.strip().splitlines()[-2:] == [
      "exgrpo_jax.train: config.rollout.vllm.max_num_seqs=0: must be an integer >= 1",
      "exgrpo_jax.train: config.rollout.vllm.dtype='foo': must be one of ('', 'float32', "
      "'bfloat16', 'float16') (\"\": the model's, model.dtype)"]
  proc = run("--debug")
  assert proc.returncode == cli.EXIT_USAGE and "Traceback" in proc.stderr
