"""The NumPy GGUF converter against transformers' PyTorch GGUF path, bit for bit, and
its cache."""

import json
import os
import shutil

import numpy as np
import pytest

from exgrpo_jax import models
from exgrpo_jax.models import gguf_convert
from exgrpo_jax.models import loading
from exgrpo_jax.models import safetensors_io

TEXTS = ["Hello world", "  two spaces\n\n\ttab <|im_start|>user\nWhat is 2+3?<|im_end|>\n",
         "ünïcödé 日本語 😀 1234567 \\boxed{\\frac{x^2}{3}} <think>\n</think>"]


@pytest.fixture(scope="module")
def gguf_path():
  try:
    return models.default_model_path()
  except FileNotFoundError as e:
    pytest.skip(f"embedded model unavailable: {e}")


def _reference_dir(path):
  return dict(zip(("pretrained_model_name_or_path", "gguf_file"), os.path.split(path)))


def test_tokenizer_and_config_match_transformers(gguf_path, tmp_path):
  import gguf  # pylint: disable=g-import-not-at-top
  pytest.importorskip("torch")  # transformers reads a GGUF only through PyTorch
  transformers = pytest.importorskip("transformers")
  reader = gguf.GGUFReader(gguf_path)
  meta = {name: field.contents() for name, field in reader.fields.items()}
  gguf_convert.save_tokenizer(meta, str(tmp_path))
  ours = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  ref = transformers.AutoTokenizer.from_pretrained(**_reference_dir(gguf_path))
  assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
  assert ours.chat_template == ref.chat_template and ours.chat_template
  assert ours.special_tokens_map == ref.special_tokens_map
  for text in TEXTS:
    assert ours(text)["input_ids"] == ref(text)["input_ids"]
  messages = [{"role": "user", "content": TEXTS[2]}]
  assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
      ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

  config = gguf_convert.hf_config(meta, {t.name for t in reader.tensors}, gguf_path)
  (tmp_path / "config.json").write_text(json.dumps(config))
  ref_config = transformers.AutoConfig.from_pretrained(**_reference_dir(gguf_path))
  ref_dir = tmp_path / "ref"
  ref_config.save_pretrained(str(ref_dir))
  assert loading.read_config(str(tmp_path)) == loading.read_config(str(ref_dir))


def test_unsupported_architecture_is_one_line():
  with pytest.raises(ValueError, match=r"m\.gguf: GGUF architecture 'gemma' is not supported"):
    gguf_convert.hf_config({"general.architecture": "gemma"}, set(), "m.gguf")


def test_a_transformers_without_the_gguf_tokenizer_tables_is_one_line(gguf_path, tmp_path,
                                                                      monkeypatch):
  """transformers 5.17 (the GPU image's) lacks the tables: one line, nothing written."""
  from transformers.integrations.gguf import gguf_tokenizer_mapping  # pylint: disable=g-import-not-at-top
  monkeypatch.delattr(gguf_tokenizer_mapping, "GGUF_TOKENIZER_MAPPING")
  with pytest.raises(ImportError, match=r"needs transformers>=5\.18, not .*: pip install"):
    gguf_convert.convert(gguf_path, str(tmp_path / "hf"))
  assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_weights_are_bit_identical_to_transformers(gguf_path, tmp_path):
  torch = pytest.importorskip("torch")  # the reference path; the converter itself needs none
  transformers = pytest.importorskip("transformers")
  gguf_convert.convert(gguf_path, str(tmp_path))
  ours = safetensors_io.open_checkpoint(str(tmp_path))
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      **_reference_dir(gguf_path), dtype=torch.float32).state_dict()
  assert set(ref) - set(ours) == {"lm_head.weight"}  # tied to the embedding
  for name, file in ours.items():
    mine, theirs = file[name], ref[name].numpy()
    assert mine.dtype == theirs.dtype == np.float32 and mine.shape == theirs.shape, name
    assert np.array_equal(mine.view(np.uint32), theirs.view(np.uint32)), name


def test_the_cache_is_shared_by_copies_of_the_same_file(gguf_path, tmp_path, monkeypatch,
                                                        capfd):
  monkeypatch.setenv("EXGRPO_JAX_CACHE", str(tmp_path / "cache"))
  first = loading.gguf_to_hf_dir(gguf_path)
  assert "converting" in capfd.readouterr().err
  copy = tmp_path / "another_install" / os.path.basename(gguf_path)
  copy.parent.mkdir()
  shutil.copyfile(gguf_path, copy)  # another path, another mtime: a second venv's file
  assert loading.gguf_to_hf_dir(str(copy)) == first
  assert "converting" not in capfd.readouterr().err
  assert os.listdir(tmp_path / "cache" / "gguf") == [os.path.basename(first)]
