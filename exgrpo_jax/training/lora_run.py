"""A LoRA run's state (`model.lora.rank` > 0): what `RunState` creates, checkpoints and
checks on resume.

The run's params are `lora.LoraParams`: the frozen base, loaded (or random-initialised)
exactly as a full fine-tuning run loads its params (`models/lora_base.py`), and the
adapters. Checkpoints hold the adapters and their optimizer state only; the base is
named in the checkpoint's meta by its path and a content hash
(`lora_base.base_fingerprint`), and a resume against another base, or with another
`model.lora` section, is refused in one line before any array is read.
The exported PEFT adapter names its base by `adapter_base`.
"""

import os

import jax

from exgrpo_jax import models
from exgrpo_jax import sharding
from exgrpo_jax.models import lora
from exgrpo_jax.training import config_check


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
  return os.path.abspath(models.resolve_hf_dir(config.model.path
                                               or models.default_model_path()))


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
