"""Serving a run's export elsewhere (docs/serving.md): the PEFT adapter of a LoRA run
finds its base through the name it carries, not the training machine's path, and the
chat requests the docs give render the prompts the run trained on.

vLLM serving the merged export and the adapter: tests/vllm_real_test.py.
"""

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import smollm2_135m
from configs import tiny
from exgrpo_jax import checkpointing
from exgrpo_jax import convert
from exgrpo_jax import models
from exgrpo_jax.data import questions as questions_lib
from exgrpo_jax.data import templates
from exgrpo_jax.models import export
from exgrpo_jax.training import lora_run
from exgrpo_jax.training import trainer as trainer_lib
from tests import conftest

HUB_ID = "exgrpo-test/tiny-base"
# What AutoPeftModelForCausalLM does with an adapter directory alone: for each adapter
# argv[3:], the logits of argv[1]'s ids, saved as argv[2] % i.
_PEFT_LOGITS = """
import sys
import numpy as np
import peft
import torch
ids = torch.tensor(np.load(sys.argv[1]))
for i, adapter in enumerate(sys.argv[3:]):
  model = peft.AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32)
  with torch.no_grad():
    np.save(sys.argv[2] % i, model.eval()(ids).logits.numpy())
"""


def _peft_logits(adapters, ids, tmp_path, **env) -> list[np.ndarray]:
  """Each adapter's logits on its base as PEFT loads them, in a process of its own
  (huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when imported)."""
  ids_path, out = str(tmp_path / "ids.npy"), str(tmp_path / "logits_%d.npy")
  np.save(ids_path, ids)
  environ = conftest.subprocess_env(**env)
  for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE"):
    environ.pop(name, None)
  proc = subprocess.run([sys.executable, "-c", _PEFT_LOGITS, ids_path, out, *adapters],
                        env=environ, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [np.load(out % i) for i in range(len(adapters))]


def _into_hub_cache(hf_home, hub_id: str, model_dir: str) -> None:
  """`model_dir` as huggingface_hub's cache holds a downloaded `hub_id` (a snapshot and
  the ref `main` naming it), so transformers finds it offline."""
  revision = "0" * 40
  repo = os.path.join(hf_home, "hub", f"models--{hub_id.replace('/', '--')}")
  shutil.copytree(model_dir, os.path.join(repo, "snapshots", revision))
  os.makedirs(os.path.join(repo, "refs"))
  with open(os.path.join(repo, "refs", "main"), "w", encoding="utf-8") as f:
    f.write(revision)


@pytest.fixture(name="base")
def _base(text_model, tmp_path):
  """A tiny random HF model with SmolLM2's tokenizer, at its initial scale (logits of
  order 1, where the parity tolerance applies)."""
  cfg, _, tokenizer = text_model
  path = str(tmp_path / "base")
  export.save_pretrained(cfg, models.init_params(cfg, jax.random.key(3)), path)
  tokenizer.save_pretrained(path)
  return path


def test_a_runs_adapter_loads_with_auto_peft_after_its_base_moved(base, tmp_path):
  """A LoRA run on a local base whose config names the base's hub id: its export's
  adapter names the hub id, and `AutoPeftModelForCausalLM.from_pretrained(adapter)`
  finds the base in the hub cache (offline) after the training path is gone; the convert
  CLI's `--adapter-base` names a path of the serving machine instead. Both give the
  trainer's logits within the HF parity tolerance (1e-4, tests/models_test.py)."""
  pytest.importorskip("torch")
  pytest.importorskip("peft", reason="peft is not installed (the `test` extra)")
  config = tiny.get_config()
  config.model.update(random_init=False, path=base, lora=dict(rank=4))
  config.model.hub_id = HUB_ID  # a config key of its own where the configs carry it
  config.optim.lr, config.rollout.max_new_tokens, config.train.steps = 0.05, 8, 1
  run = str(tmp_path / "run")
  trainer_lib.Trainer(config, run).run()
  served = str(tmp_path / "served" / "base")  # where the serving machine keeps the base
  assert convert.main([f"--src={run}", f"--dst={tmp_path / 'export'}",
                       f"--adapter-base={served}"]) == 0

  cfg, params, _ = checkpointing.load_policy_for_export(run)
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)
  ours = np.asarray(models.apply(cfg, params, ids)[0])
  assert np.abs(ours - np.asarray(models.apply(cfg, params.base, ids)[0])).max() > 1e-2
  _into_hub_cache(tmp_path / "hf_home", HUB_ID, base)
  shutil.copytree(base, served)
  shutil.rmtree(base)

  by_hub_id, by_path = _peft_logits(
      [os.path.join(run, "hf", "adapter"), str(tmp_path / "export" / "adapter")], ids,
      tmp_path, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1")
  assert np.abs(by_hub_id - ours).max() <= 1e-4
  assert np.abs(by_path - ours).max() <= 1e-4


def test_the_adapter_names_the_hub_id_else_a_directory_transformers_loads():
  """`model.hub_id` where the config sets one; else the base's HF directory (of the
  embedded .gguf: its converted directory, since transformers cannot load a .gguf path);
  nothing for a random base."""
  config = smollm2_135m.get_config()
  named = lora_run.adapter_base(config)
  assert named == models.resolve_hf_dir(models.default_model_path())
  assert os.path.isfile(os.path.join(named, "config.json"))
  config.model.hub_id = "org/model"
  assert lora_run.adapter_base(config) == "org/model"
  assert lora_run.adapter_base(tiny.get_config()) == ""


def test_convert_refuses_an_adapter_base_for_a_run_without_adapters(tmp_path, capsys):
  """Only a LoRA run's export has an adapter: one line, status 2, nothing loaded or
  written."""
  assert convert.main([f"--src={tmp_path}", f"--dst={tmp_path / 'out'}",
                       "--adapter-base=org/model"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "--adapter-base=org/model:" in err[0] and "no adapter" in err[0]
  assert not os.path.exists(tmp_path / "out")


def test_the_documented_think_request_renders_the_training_prompt():
  """docs/serving.md's chat request for `exgrpo_think` (ExGRPO's system prompt, the
  question, an assistant turn "<think>\\n" continued) renders, through a ChatML chat
  template (SmolLM2's, as Qwen2.5's), the text the run trained on."""
  tokenizer = models.load_tokenizer()
  question = questions_lib.Question(
      uid=0, messages=({"role": "user", "content": "What is 7 + 8?"},), ground_truth="15",
      data_source="arithmetic", reward_name="math")
  messages = [{"role": "system", "content": templates.EXGRPO_SYSTEM_PROMPT},
              {"role": "user", "content": question.problem},
              {"role": "assistant", "content": "<think>\n"}]
  served = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                         continue_final_message=True)
  assert served == templates.exgrpo_think(question, tokenizer)
