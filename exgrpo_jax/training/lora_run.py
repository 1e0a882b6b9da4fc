"""A LoRA run's state (`model.lora.rank` > 0): what `RunState` creates, checkpoints and
checks on resume.

The run's params are `lora.LoraParams`: the frozen base, loaded (or random-initialised)
exactly as a full fine-tuning run loads its params, and the adapters. Checkpoints hold
the adapters and their optimizer state only; the base is named in the checkpoint's meta
by its path and a content hash (`base_fingerprint`), and a resume against another base,
or with another `model.lora` section, is refused in one line before any array is read.
The exported PEFT adapter names its base by `adapter_base`.
"""

import hashlib
import json
import os

import jax
import ml_collections

from exgrpo_jax import models
from exgrpo_jax import sharding
from exgrpo_jax.models import loading
from exgrpo_jax.models import lora
from exgrpo_jax.models import quant
from exgrpo_jax.training import config_check

# Weight files whose bytes identify a Hugging Face base directory.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def enabled(config) -> bool:
  return config.model.lora.rank > 0


def adapter_shardings(config, model_cfg, mesh):
  c = config.model.lora
  return lora.adapter_shardings(model_cfg, c.rank, tuple(c.targets), mesh)


def init_adapters(config, model_cfg, shardings):
  """The run's initial adapters, from `train.seed` (a stream apart from the base's)."""
  c = config.model.lora
  rng = jax.random.fold_in(jax.random.key(config.train.seed), 1)
  return lora.init_adapters(model_cfg, c.rank, tuple(c.targets), rng, shardings)


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


def adapter_base(config) -> str:
  """What the exported PEFT adapter names as its base (`base_model_name_or_path`): the
  config's `model.hub_id` where it sets one, portable wherever the hub or its cache is
  reached; else the base's local Hugging Face directory (of a .gguf: the directory it is
  converted to, which transformers loads, not the .gguf); "" for `model.random_init`,
  whose base exists nowhere else."""
  hub_id = config.model.get("hub_id")
  if hub_id:
    return hub_id
  if config.model.random_init:
    return ""
  return os.path.abspath(models.resolve_hf_dir(config.model.path or models.default_model_path()))


def abstract_base(config, model_cfg):
  """ShapeDtypeStructs of the frozen base (quantized with `model.lora.base_quant`)."""
  return lora.abstract_base(models.abstract_params(model_cfg), config.model.lora.base_quant)


def base_shardings(config, model_cfg, mesh):
  """The frozen base's shardings on `mesh`: the params' (`models.param_shardings`),
  a quantized weight's codes like its weight and its scales along the axes they run
  along (`quant.logical_axes`)."""
  abstract = abstract_base(config, model_cfg)
  names = lora.base_logical_axes(models.logical_axes(model_cfg), abstract)
  return sharding.tree_shardings(names, abstract, mesh)


def base_weights(config, model_cfg, shardings=None):
  """The frozen base as a run with `config` loads it: `model.path` (or the embedded
  model), or the random weights of `model.random_init` drawn from `train.seed`; with
  `model.lora.base_quant`, each layer projection quantized as it is placed
  (`shardings`: `base_shardings`)."""
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


def check_resume(meta: dict, config, fingerprint) -> None:
  """Raises ConfigError if the checkpoint with `meta` was trained with another
  `model.lora` section, or (LoRA) on another base than `fingerprint()` describes."""
  saved = dict(lora.DEFAULTS, **meta["config"]["model"].get("lora", {}))
  now = config.model.lora.to_dict()
  for key in ("rank", "alpha", "targets", "base_quant"):
    if saved[key] != now[key]:
      raise config_check.ConfigError(
          f"config.model.lora.{key}={now[key]!r}: the checkpoint being resumed was trained "
          f"with {saved[key]!r}; resume with that value or start a new workdir")
  if not enabled(config):
    return
  base, want = fingerprint(), meta.get("lora_base", {})
  if base["sha256"] != want.get("sha256"):
    key = "random_init" if config.model.random_init else "path"
    raise config_check.ConfigError(
        f"config.model.{key}={config.model[key]!r}: the LoRA checkpoint being resumed was "
        f"trained on the base {want.get('path')!r} (sha256 {want.get('sha256', '?')[:12]}), "
        f"not {base['path']!r} (sha256 {base['sha256'][:12]}); resume with that base or "
        "start a new workdir")
