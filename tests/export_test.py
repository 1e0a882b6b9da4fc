"""HF export round trips, the convert CLI, and clear errors on bad checkpoints."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from exgrpo_jax import models
from exgrpo_jax.models import safetensors_io

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests import models_test  # pylint: disable=g-import-not-at-top


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("qwen"))
  models_test.make_hf_model("qwen2", tied=False, seed=3).save_pretrained(path)
  return path


def read_all(directory):
  files = safetensors_io.open_checkpoint(directory)
  return {name: np.asarray(f[name]) for name, f in files.items()}


def test_our_params_to_hf_give_same_logits(tmp_path):
  cfg = models.ModelConfig(model_type="llama", vocab_size=200, hidden_size=64,
                           intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=1,
                           head_dim=16, tie_word_embeddings=False, eos_token_id=(2,),
                           rope_scaling=(("factor", 4.0), ("high_freq_factor", 4.0),
                                         ("low_freq_factor", 1.0),
                                         ("original_max_position_embeddings", 32.0)))
  params = models.init_params(cfg, jax.random.key(7))
  models.save_pretrained(cfg, params, str(tmp_path))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                               dtype=torch.float32)
  ids = models_test.random_ids((2, 40), cfg.vocab_size)
  ours = np.asarray(models.apply(cfg, params, ids)[0])
  assert np.abs(models_test.hf_logits(hf_model, ids) - ours).max() <= 1e-4


def test_hf_to_ours_to_hf_same_bytes(qwen_dir, tmp_path):
  policy = models.from_pretrained(qwen_dir)
  models.save_pretrained(policy.config, policy.params, str(tmp_path))
  before, after = read_all(qwen_dir), read_all(str(tmp_path))
  assert sorted(before) == sorted(after)
  for name, array in before.items():
    assert after[name].dtype == array.dtype, name
    assert after[name].tobytes() == array.tobytes(), name


def test_bf16_and_sharded_export(qwen_dir, tmp_path):
  policy = models.from_pretrained(qwen_dir)
  models.save_pretrained(policy.config, policy.params, str(tmp_path), dtype="bfloat16",
                         max_shard_bytes=60_000)
  index = json.load(open(tmp_path / "model.safetensors.index.json"))
  assert len(set(index["weight_map"].values())) > 1
  assert json.load(open(tmp_path / "config.json"))["torch_dtype"] == "bfloat16"
  reloaded = models.from_pretrained(str(tmp_path))
  for a, b in zip(jax.tree.leaves(reloaded.params), jax.tree.leaves(policy.params)):
    np.testing.assert_array_equal(np.asarray(a),
                                  np.asarray(b.astype(jax.numpy.bfloat16)).astype(np.float32))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
  assert next(hf_model.parameters()).dtype == torch.bfloat16


def test_convert_cli_hf_dir(qwen_dir, tmp_path):
  dst = tmp_path / "out"
  proc = subprocess.run([sys.executable, "-m", "exgrpo_jax.convert", "--src", qwen_dir,
                         "--dst", str(dst)], capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr
  assert read_all(str(dst)).keys() == read_all(qwen_dir).keys()


def test_convert_cli_reports_bad_source(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "exgrpo_jax.convert", "--src",
                         str(tmp_path / "nope"), "--dst", str(tmp_path / "out")],
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith("error: model path does not exist")


def test_error_no_config_json(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    models.from_pretrained(str(tmp_path))


def test_error_unsupported_model_type(qwen_dir, tmp_path):
  shutil.copytree(qwen_dir, tmp_path, dirs_exist_ok=True)
  cfg = json.load(open(tmp_path / "config.json"))
  cfg["model_type"] = "gpt2"
  json.dump(cfg, open(tmp_path / "config.json", "w"))
  with pytest.raises(ValueError, match="unsupported model_type 'gpt2'") as e:
    models.from_pretrained(str(tmp_path))
  assert "\n" not in str(e.value)


def test_error_missing_tensor(qwen_dir, tmp_path):
  shutil.copytree(qwen_dir, tmp_path, dirs_exist_ok=True)
  tensors = read_all(str(tmp_path))
  del tensors["model.layers.1.mlp.up_proj.weight"]
  safetensors_io.save_file(tensors, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
    models.from_pretrained(str(tmp_path))


def test_error_wrong_shape(qwen_dir, tmp_path):
  shutil.copytree(qwen_dir, tmp_path, dirs_exist_ok=True)
  tensors = read_all(str(tmp_path))
  tensors["model.norm.weight"] = np.ones(3, np.float32)
  safetensors_io.save_file(tensors, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="model.norm.weight has shape"):
    models.from_pretrained(str(tmp_path))


def test_default_model_path_points_to_gguf():
  path = models.default_model_path()
  assert path.endswith(".gguf") and os.path.getsize(path) > 50e6
