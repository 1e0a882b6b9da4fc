"""Model hyper-parameters for the Llama/Qwen2 decoder family, and HF config conversion.

One frozen dataclass covers Llama 3/3.1 (GQA, llama3 rope scaling), Qwen2/2.5 (q/k/v
bias, tied or untied embeddings) and SmolLM2 (a small Llama). `from_hf_config` reads a
transformers `config.json` dict; `to_hf_config` writes one back that transformers loads.
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
# Rematerialisation of each decoder layer in the backward pass: "none", "full" (save
# nothing) or "dots" (save matmul outputs without batch dims).
REMATS = ("none", "full", "dots")
ATTENTIONS = ("auto", "xla", "blockwise", "cudnn", "splash")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# JAX's matmul precision for a run (`model.matmul_precision`). Its own default lowers a
# float32 matmul to TF32 on NVIDIA GPUs (one bfloat16 pass on TPU): on an H200 SmolLM2's
# log-probs then differed from transformers' by up to 0.074, and by 1.4e-4 at "highest".
MATMUL_PRECISIONS = ("auto", "default", "high", "highest")


def dtype_from_name(name: str):
  """Maps 'float32' / 'bfloat16' / 'float16' (or a jnp dtype) to a jnp dtype."""
  if not isinstance(name, str):
    return jnp.dtype(name).type
  if name not in _DTYPES:
    raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
  return _DTYPES[name]


def matmul_precision(name: str, dtype: str) -> str:
  """The JAX matmul precision `name` stands for at compute dtype `dtype`: "auto" is
  "highest" for float32 (float32 means float32 on every backend) and "default" for 16-bit
  compute, whose matmuls it does not change."""
  if name not in MATMUL_PRECISIONS:
    raise ValueError(f"matmul precision must be one of {MATMUL_PRECISIONS}, got {name!r}")
  if name != "auto":
    return name
  return "highest" if jnp.dtype(dtype_from_name(dtype)) == jnp.float32 else "default"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder hyper-parameters. Dimension names used across the code base:

  V vocab_size, D hidden_size, F intermediate_size, L num_layers, H num_heads,
  K num_kv_heads, Dh head_dim.
  """

  model_type: str = "llama"
  vocab_size: int = 49152
  hidden_size: int = 576
  intermediate_size: int = 1536
  num_layers: int = 30
  num_heads: int = 9
  num_kv_heads: int = 3
  head_dim: int = 64
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  # llama3 rule: dict(factor, low_freq_factor, high_freq_factor,
  # original_max_position_embeddings); None for plain RoPE.
  rope_scaling: tuple | None = None
  max_position_embeddings: int = 8192
  tie_word_embeddings: bool = True
  attention_bias: bool = False
  bos_token_id: int | None = None
  eos_token_id: tuple = ()
  pad_token_id: int | None = None
  # Storage dtype of parameters and dtype of activations / matmul inputs.
  param_dtype: str = "float32"
  dtype: str = "float32"
  remat: str = "none"  # one of REMATS
  # Attention kernel, one of ATTENTIONS (see models/attention.py); "auto" picks the best
  # the backend runs.
  attention: str = "auto"

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
          f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.remat not in REMATS:
      raise ValueError(f"remat must be one of {REMATS}, got {self.remat!r}")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
    dtype_from_name(self.param_dtype)
    dtype_from_name(self.dtype)

  @property
  def rope_scaling_dict(self) -> dict | None:
    return dict(self.rope_scaling) if self.rope_scaling else None

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    """Parameter count (embeddings included once when tied)."""
    d, f, h, k, dh = (self.hidden_size, self.intermediate_size, self.num_heads,
                      self.num_kv_heads, self.head_dim)
    attn = d * h * dh * 2 + d * k * dh * 2 + (self.attention_bias and (h + 2 * k) * dh)
    per_layer = attn + 3 * d * f + 2 * d
    embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
    return self.num_layers * per_layer + embed + d


def _as_tuple(x) -> tuple:
  if x is None:
    return ()
  return tuple(x) if isinstance(x, (list, tuple)) else (x,)


def from_hf_config(hf: dict[str, Any], **overrides) -> ModelConfig:
  """Builds a ModelConfig from a transformers config dict (config.json contents)."""
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(
        f"unsupported model_type {model_type!r} in config.json; "
        f"exgrpo_jax supports {', '.join(SUPPORTED_MODEL_TYPES)}")
  rope_scaling = hf.get("rope_scaling") or None
  rope_theta = hf.get("rope_theta")
  # transformers >= 5 moved rope settings into `rope_parameters`.
  rope_params = hf.get("rope_parameters") or {}
  if rope_theta is None:
    rope_theta = rope_params.get("rope_theta", 10000.0)
  if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
    rope_scaling = rope_params
  if rope_scaling is not None:
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type in (None, "default"):
      rope_scaling = None
    elif rope_type != "llama3":
      raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: llama3")
    else:
      rope_scaling = tuple(sorted(
          (key, float(rope_scaling[key])) for key in
          ("factor", "low_freq_factor", "high_freq_factor",
           "original_max_position_embeddings")))
  num_heads = hf["num_attention_heads"]
  hidden = hf["hidden_size"]
  fields = dict(
      model_type=model_type,
      vocab_size=hf["vocab_size"],
      hidden_size=hidden,
      intermediate_size=hf["intermediate_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads") or num_heads,
      head_dim=hf.get("head_dim") or hidden // num_heads,
      rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
      rope_theta=float(rope_theta),
      rope_scaling=rope_scaling,
      max_position_embeddings=hf.get("max_position_embeddings", 8192),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
      bos_token_id=hf.get("bos_token_id"),
      eos_token_id=_as_tuple(hf.get("eos_token_id")),
      pad_token_id=hf.get("pad_token_id"),
  )
  fields.update(overrides)
  return ModelConfig(**fields)


def to_hf_config(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
  """A transformers config dict for `cfg` (LlamaForCausalLM or Qwen2ForCausalLM)."""
  hf = dict(
      model_type=cfg.model_type,
      architectures=["LlamaForCausalLM" if cfg.model_type == "llama" else "Qwen2ForCausalLM"],
      vocab_size=cfg.vocab_size,
      hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size,
      num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
      hidden_act="silu",
      rms_norm_eps=cfg.rms_norm_eps,
      rope_theta=cfg.rope_theta,
      rope_scaling=({"rope_type": "llama3", **cfg.rope_scaling_dict}
                    if cfg.rope_scaling else None),
      max_position_embeddings=cfg.max_position_embeddings,
      tie_word_embeddings=cfg.tie_word_embeddings,
      bos_token_id=cfg.bos_token_id,
      eos_token_id=(list(cfg.eos_token_id) if len(cfg.eos_token_id) > 1
                    else (cfg.eos_token_id[0] if cfg.eos_token_id else None)),
      pad_token_id=cfg.pad_token_id,
      torch_dtype=torch_dtype,
      use_cache=True,
  )
  if cfg.model_type == "llama":
    hf.update(attention_bias=cfg.attention_bias, mlp_bias=False, attention_dropout=0.0)
  else:
    hf.update(use_sliding_window=False, sliding_window=None, attention_dropout=0.0)
  if cfg.rope_scaling and cfg.rope_scaling_dict:
    hf["rope_scaling"]["original_max_position_embeddings"] = int(
        cfg.rope_scaling_dict["original_max_position_embeddings"])
  return hf
