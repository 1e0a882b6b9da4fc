"""Every shipped config and variant loads, and the train entry point rejects typos."""

import glob
import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import common

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
# Training configs; study_*.py configure the study runner (tests/study_test.py).
NAMES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(CONFIG_DIR, "*.py"))
               if not p.endswith(("common.py", "__init__.py"))
               and not os.path.basename(p).startswith("study_"))


def test_all_model_configs_present():
  assert set(NAMES) >= {"qwen7b", "qwen1_5b", "qwen7b_instruct", "llama8b", "llama8b_instruct",
                        "smollm2_135m", "tiny"}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("variant", common.VARIANTS)
def test_config_and_variant_load(name, variant):
  c = importlib.import_module(f"configs.{name}").get_config(variant)
  assert c.replay.k == c.rollout.k
  assert 0 <= c.algo.rho < 1
  if variant == "onpolicy":
    assert c.algo.rho == 0
  if variant == "no_shaping":
    assert c.algo.shaping_gamma is None
  if variant == "rho75":
    assert c.algo.rho == 0.75


def test_paper_defaults():
  c = importlib.import_module("configs.qwen7b").get_config()
  assert (c.train.batch_questions, c.rollout.k, c.rollout.max_new_tokens) == (128, 8, 8192)
  assert (c.algo.rho, c.algo.delayed_start, c.algo.shaping_gamma) == (0.5, 0.35, 0.1)
  assert (c.optim.lr, c.optim.weight_decay, c.optim.skip_grad_norm) == (1e-6, 0.01, 500.0)
  assert c.algo.entropy_coeff == 0.001 and c.optim.mini_batches == 2
  assert (c.eval.every, c.eval.before_train) == (10, False)  # docs/algorithm.md §14
  assert importlib.import_module("configs.llama8b").get_config().algo.delayed_start == 0


@pytest.mark.parametrize("name", ["qwen7b", "qwen7b_instruct", "qwen1_5b", "llama8b",
                                  "llama8b_instruct"])
def test_paper_configs_take_the_compilers_plan_for_8_h100s(name):
  """mesh.shape, rollout.max_rows and kv_pages are what `python -m exgrpo_jax.aot plan` chose for h100x8
  from the compiler's figures (docs/results/aot_<name>_h100x8.json, docs/aot.md)."""
  base = name.removesuffix("_instruct")  # the instruct models have their base's shapes
  path = os.path.join(os.path.dirname(CONFIG_DIR), "docs", "results", f"aot_{base}_h100x8.json")
  with open(path, encoding="utf-8") as f:
    plan = json.load(f)
  c = importlib.import_module(f"configs.{name}").get_config()
  assert plan["fits"] and c.mesh.shape == (-1, plan["chosen"]["tensor"])
  assert c.optim.micro_batch_size == plan["chosen"]["micro_batch_size"]
  rows = c.train.batch_questions * c.rollout.k
  assert (c.rollout.max_rows or rows) == plan["chosen"]["max_rows"]
  assert c.rollout.kv_pages == plan["chosen"].get("kv_pages", 0)


def _plans(name: str) -> dict:
  """{DEVICE: chosen settings} of every fitting docs/results/aot_<name>_<DEVICE>.json."""
  plans = {}
  for path in glob.glob(os.path.join(common.PLANS, f"aot_{name}_*.json")):
    device = os.path.basename(path)[len(f"aot_{name}_"):-len(".json")]
    with open(path, encoding="utf-8") as f:
      plan = json.load(f)
    if device in common.targets.TARGETS and plan["fits"]:
      plans[device] = plan["chosen"]
  return plans


@pytest.mark.parametrize("name, plans", [
    ("qwen7b_lora", "qwen7b_lora"), ("llama8b_lora", "llama8b_lora"),
    ("qwen7b", "qwen7b"), ("qwen7b_instruct", "qwen7b"), ("llama8b", "llama8b"),
    ("llama8b_instruct", "llama8b"), ("qwen1_5b", "qwen1_5b")])
def test_configs_take_every_committed_plan_by_its_device(name, plans):
  """`configs/<name>.py:DEVICE` has the mesh, micro-batch, rollout slots and KV pool of
  docs/results/aot_<plans>_<DEVICE>.json, for every such plan that fits: a new plan is
  taken without editing the config."""
  module = importlib.import_module(f"configs.{name}")
  found = _plans(plans)
  assert found
  for device, chosen in found.items():
    for arg in (device, f"{device},onpolicy"):
      c = module.get_config(arg)
      devices = common.targets.get(device).devices
      assert (f"--config.mesh.shape='({devices // chosen['tensor']}, {chosen['tensor']})'"
              in chosen["flags"]) and c.mesh.shape == (-1, chosen["tensor"])
      assert c.optim.micro_batch_size == chosen["micro_batch_size"]
      assert (c.rollout.max_rows, c.rollout.kv_pages) == (chosen["max_rows"],
                                                          chosen.get("kv_pages", 0))
      if name.endswith("_lora"):
        assert c.model.lora.rank == 16 and c.model.param_dtype == "bfloat16"
        # docs/lora.md's recipe: alpha 16 at any rank, 30 times full fine-tuning's rate.
        assert c.model.lora.alpha == 16.0
        paper = importlib.import_module(f"configs.{name[:-len('_lora')]}").get_config()
        assert c.optim.lr == pytest.approx(30 * paper.optim.lr)
    assert module.get_config(f"{device},onpolicy").algo.rho == 0
  if name.endswith("_lora"):
    assert module.get_config().rollout.max_rows == 0  # left for the planner


def test_a_device_or_variant_the_config_does_not_take_is_one_error_listing_both():
  lora = importlib.import_module("configs.qwen7b_lora")
  with pytest.raises(ValueError, match=r"give at most one device and one variant .*"
                     r"unknown: v9; devices: v4-8, .*h200x8; variants: exgrpo, onpolicy"):
    lora.get_config("v9")
  with pytest.raises(ValueError, match="at most one device and one variant"):
    lora.get_config("onpolicy,rho75")
  with pytest.raises(ValueError, match=r"no plan for v5p-16 yet \(planned: .*h100x1.*\); "
                     r"make one with `.aot/tpu/bin/python -m exgrpo_jax.aot plan "
                     r"--config=configs/qwen7b_lora.py --target=v5p-16 "
                     r"--out=docs/results/aot_qwen7b_lora_v5p-16.json` \(`bash "
                     r"scripts/accelerator/aot_env.sh tpu` makes .aot/tpu"):
    lora.get_config("v5p-16")
  with pytest.raises(ValueError, match=r"config argument 'h100x1': give "
                     r"one variant; unknown: h100x1; variants: exgrpo, onpolicy"):
    importlib.import_module("configs.tiny").get_config("h100x1")


def test_unknown_variant_is_an_error():
  with pytest.raises(ValueError, match="unknown: nope"):
    importlib.import_module("configs.tiny").get_config("nope")


def test_train_cli_rejects_unknown_key(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "exgrpo_jax.train", "--config=configs/tiny.py",
       f"--workdir={tmp_path}", "--config.algo.rhoo=0.3"],
      capture_output=True, text=True, check=False,
      cwd=os.path.dirname(CONFIG_DIR))
  assert proc.returncode != 0
  assert "rhoo" in proc.stderr


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("k", [4, 8, 16])
def test_bucket_probs_follow_spec_with_sigma_one_over_k(name, k):
  """docs/algorithm.md §4: weight exp(-(k - K/2)^2 / 2) over buckets 1..K-1 (sigma = 1/K)."""
  from exgrpo_jax.replay import buckets  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.replay import buffer  # pylint: disable=g-import-not-at-top
  c = importlib.import_module(f"configs.{name}").get_config()
  c.rollout.k = k
  sizes = np.array([0] + [3] * (k - 1) + [0])
  counts = np.arange(k + 1)
  spec = np.where((counts > 0) & (counts < k), np.exp(-(counts - k / 2) ** 2 / 2), 0)
  # The buffer reads sigma as the trainer hands it over (config.replay).
  sigma = buffer.BufferConfig.from_mapping(c.replay.to_dict()).sigma_acc
  probs = buckets.bucket_probs(sizes, mu=c.replay.mu, sigma=sigma,
                               weighting=c.replay.weighting)
  np.testing.assert_allclose(probs, spec / spec.sum(), rtol=1e-12)


def test_derived_values_follow_their_source_and_detach_when_overridden():
  c = importlib.import_module("configs.tiny").get_config()
  c.rollout.max_new_tokens = 32
  c.rollout.k = 8
  assert (c.algo.norm_len, c.replay.k, c.replay.sigma) == (32, 8, 1 / 8)
  c.algo.norm_len = 7
  c.replay.sigma = 0.3
  assert (c.rollout.max_new_tokens, c.rollout.k) == (32, 8)
  assert (c.algo.norm_len, c.replay.sigma) == (7, 0.3)


def _flat(d, prefix=""):
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


@pytest.mark.parametrize("variant", [v for v in common.VARIANTS if v != "exgrpo"])
def test_variant_changes_only_its_table_entry(variant):
  base = _flat(importlib.import_module("configs.tiny").get_config().to_dict())
  changed = _flat(importlib.import_module("configs.tiny").get_config(variant).to_dict())
  diff = {k for k in base if base[k] != changed[k]}
  if variant == "no_shaping":  # only the replayed tokens' objective changes
    assert diff == {"algo.shaping_gamma"}
  assert diff == {k for k, v in common.VARIANTS[variant][0].items() if base[k] != v}
