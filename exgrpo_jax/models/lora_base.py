"""The frozen base of a LoRA run (`model.lora.rank` > 0), and how its checkpoints name it.

  base = lora_base.base_weights(config, model_cfg, shardings)   # as the run loads it
  params = lora_base.combine(config, base, adapters)
  meta["lora_base"] = lora_base.base_fingerprint(config, path)  # {"path", "sha256"}
  params = lora_base.with_checkpoint_base(meta, model_cfg, adapters)  # export, evaluation

A LoRA checkpoint holds the adapters only; its meta names the base by path and by a
hash of its weights' bytes, so a resume, an export or an evaluation finds the base it
was trained on, or is refused in one line when that base's content changed. The
trainer (`training/lora_run.py`) and the checkpoint store (`checkpointing.py`) both
read it.
"""

import hashlib
import json
import os

import jax
import ml_collections

from exgrpo_jax import models
from exgrpo_jax.models import loading
from exgrpo_jax.models import lora
from exgrpo_jax.models import quant

# Weight files whose bytes identify a Hugging Face base directory.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def combine(config, base, adapters) -> lora.LoraParams:
  return lora.LoraParams(base, adapters, lora.scale(config.model.lora))


def _sha256_of_files(paths) -> str:
  digest = hashlib.sha256()
  for path in paths:
    digest.update(os.path.basename(path).encode())
    with open(path, "rb") as f:
      while chunk := f.read(1 << 24):
        digest.update(chunk)
  return digest.hexdigest()


def base_fingerprint(config, model_path: str) -> dict:
  """{"path", "sha256"} of the frozen base: the model file, or a directory's weight files
  (their bytes, in name order); for `model.random_init`, of its architecture and seed,
  which determine its weights."""
  m = config.model
  if m.random_init:
    spec = json.dumps(dict(arch=m.arch.to_dict(), seed=config.train.seed,
                           param_dtype=m.param_dtype), sort_keys=True)
    return dict(path="random_init", sha256=hashlib.sha256(spec.encode()).hexdigest())
  if os.path.isfile(model_path):
    files = [model_path]
  else:
    files = sorted(os.path.join(model_path, name) for name in os.listdir(model_path)
                   if name.endswith(_WEIGHT_SUFFIXES))
  return dict(path=os.path.abspath(model_path), sha256=_sha256_of_files(files))


def base_weights(config, model_cfg, shardings=None):
  """The frozen base as a run with `config` loads it: `model.path` (or the embedded
  model), or the random weights of `model.random_init` drawn from `train.seed`; with
  `model.lora.base_quant`, each layer projection quantized as it is placed
  (`shardings`: `lora_run.base_shardings`)."""
  kind = config.model.lora.base_quant
  plain = None if shardings is None else quant.plain_shardings(shardings)
  if config.model.random_init:
    base = models.init_params(model_cfg, jax.random.key(config.train.seed), plain)
    return lora.quantize_base(base, kind, shardings)
  hf_dir = models.resolve_hf_dir(config.model.path or models.default_model_path())
  return loading.load_params(
      hf_dir, model_cfg, plain,
      convert=lambda path, w: lora.quantize_weight(path, w, kind, shardings))


def with_checkpoint_base(meta: dict, model_cfg, adapters) -> lora.LoraParams:
  """A LoRA checkpoint's adapters on the base its `meta` names (export and evaluation);
  ValueError in one line if that base's content is no longer the one trained on."""
  config = ml_collections.ConfigDict(meta["config"])
  path = config.model.path or models.default_model_path()
  want, base = meta["lora_base"], base_fingerprint(config, path)
  if base["sha256"] != want["sha256"]:
    raise ValueError(f"{want['path']}: the LoRA base's weights changed since the checkpoint "
                     f"was written (sha256 {want['sha256'][:12]} -> {base['sha256'][:12]})")
  return combine(config, base_weights(config, model_cfg), adapters)
