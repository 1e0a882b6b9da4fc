"""Writing our parameters as a Hugging Face directory that transformers loads.

`save_pretrained(cfg, params, dst)` writes config.json, generation_config.json and
safetensors (sharded with an index above `max_shard_bytes`), inverting the key table;
`tokenizer_src` (an HF directory or .gguf) adds the tokenizer files; of LoRA params,
`adapter/` holds the adapter alone, naming `adapter_base` as its base.

Atomic: everything is written to a temporary sibling directory, `EXPORT_INFO` (what was
exported, e.g. the training step) last, and the directory is then renamed into place,
so `dst` is either the previous export or the complete new one. `is_complete(dst, info)`
tells a rerun whether its export is already there.
"""

import json
import os
import shutil

import jax
import numpy as np

from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import hf_keys
from exgrpo_jax.models import loading
from exgrpo_jax.models import lora
from exgrpo_jax.models import peft_export
from exgrpo_jax.models import safetensors_io


def hf_state_dict(cfg: config_lib.ModelConfig, params, dtype: str | None = None):
  """Yields (HF name, numpy array) for every tensor, one at a time (LoRA params: of the
  merged model, `lora.merged`)."""
  params = lora.merged(params)
  np_dtype = np.dtype(config_lib.dtype_from_name(dtype)) if dtype else None
  for template, path, layout in hf_keys.key_table(cfg):
    array = params
    for key in path:
      array = array[key]
    array = np.asarray(jax.device_get(array))
    if np_dtype is not None:
      array = array.astype(np_dtype)
    names = hf_keys.hf_names(template, cfg.num_layers)
    for i, name in enumerate(names):
      yield name, np.ascontiguousarray(hf_keys.to_hf(array[i] if "{i}" in template
                                                     else array, layout))


EXPORT_INFO = "exgrpo_export.json"


def is_complete(dst: str, info: dict) -> bool:
  """Whether `dst` holds a finished export whose EXPORT_INFO includes `info`."""
  try:
    with open(os.path.join(dst, EXPORT_INFO), encoding="utf-8") as f:
      written = json.load(f)
  except (OSError, ValueError):
    return False
  return all(written.get(k) == v for k, v in info.items())


def replaceable(dst: str) -> bool:
  """`dst` is absent, empty, or a model directory (a previous export)."""
  if not os.path.exists(dst):
    return True
  return os.path.isdir(dst) and (not os.listdir(dst) or any(
      os.path.exists(os.path.join(dst, name)) for name in (EXPORT_INFO, "config.json")))


def save_pretrained(cfg: config_lib.ModelConfig, params, dst: str, dtype: str | None = None,
                    tokenizer_src: str | None = None, max_shard_bytes: int = 5 * 2**30,
                    info: dict | None = None, adapter_base: str = ""):
  """Writes an HF model directory atomically; returns its path. LoRA params
  (`lora.LoraParams`) give the merged model, and their adapters as a PEFT adapter
  directory `adapter/` inside it (`peft_export`) whose `base_model_name_or_path` is
  `adapter_base` (a hub id or a path: `lora_run.adapter_base`)."""
  dst = os.path.abspath(dst)
  if not replaceable(dst):
    raise FileExistsError(f"{dst} exists and is not a model directory; not overwriting it")
  _remove_stale_temporaries(dst)
  tmp = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.tmp-{os.getpid()}")
  os.makedirs(tmp)
  try:
    _write(cfg, params, tmp, dtype or cfg.param_dtype, tokenizer_src, max_shard_bytes)
    if isinstance(params, lora.LoraParams):
      peft_export.write_adapter(cfg, params, os.path.join(tmp, peft_export.ADAPTER_DIR),
                                adapter_base)
    with open(os.path.join(tmp, EXPORT_INFO), "w", encoding="utf-8") as f:
      json.dump(dict(info or {}, dtype=dtype or cfg.param_dtype), f)
    old = None
    if os.path.exists(dst):
      old = f"{tmp}.old"
      os.rename(dst, old)
    os.rename(tmp, dst)
    if old:
      shutil.rmtree(old)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return dst


def _remove_stale_temporaries(dst: str) -> None:
  """Temporary directories of exports killed midway (their process is gone)."""
  parent, prefix = os.path.dirname(dst), f".{os.path.basename(dst)}.tmp-"
  for name in os.listdir(parent) if os.path.isdir(parent) else ():
    pid = name[len(prefix):].split(".")[0]
    if name.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
      shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _alive(pid: int) -> bool:
  if pid == os.getpid():
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return True


def _write(cfg, params, dst: str, dtype: str, tokenizer_src: str | None,
           max_shard_bytes: int) -> None:
  shards, current, size = [], {}, 0
  for name, array in hf_state_dict(cfg, params, dtype):
    if current and size + array.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = array
    size += array.nbytes
  shards.append(current)
  if len(shards) == 1:
    safetensors_io.save_file(shards[0], os.path.join(dst, "model.safetensors"),
                             metadata={"format": "pt"})
  else:
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
      filename = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
      safetensors_io.save_file(shard, os.path.join(dst, filename), metadata={"format": "pt"})
      weight_map.update({name: filename for name in shard})
      total += sum(a.nbytes for a in shard.values())
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(config_lib.to_hf_config(cfg, torch_dtype=dtype), f, indent=2)
  generation = {"bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
                "eos_token_id": list(cfg.eos_token_id) or None}
  with open(os.path.join(dst, "generation_config.json"), "w") as f:
    json.dump({k: v for k, v in generation.items() if v is not None}, f, indent=2)
  if tokenizer_src:
    loading.load_tokenizer(tokenizer_src).save_pretrained(dst)
