"""Declarative map between Hugging Face tensor names and our parameter tree.

Each row is (HF name template, our parameter path, layout). `{i}` marks a per-layer
tensor; ours are stacked on a leading `layers` axis (the model scans over layers).
Layouts say how an HF `nn.Linear` weight [out, in] becomes our einsum kernel:

  copy       same array (embeddings, norm scales)
  in_heads   [N*Dh, D] -> [D, N, Dh]   (q/k/v projections)
  out_heads  [D, H*Dh] -> [H, Dh, D]   (attention output projection)
  heads      [N*Dh]    -> [N, Dh]      (q/k/v bias)
  linear     [out, in] -> [in, out]    (MLP, untied LM head)
"""

import numpy as np

from exgrpo_jax.models import config as config_lib

_LLAMA = (
    ("model.embed_tokens.weight", ("embed",), "copy"),
    ("model.norm.weight", ("final_norm", "scale"), "copy"),
    ("model.layers.{i}.input_layernorm.weight", ("layers", "input_norm", "scale"), "copy"),
    ("model.layers.{i}.post_attention_layernorm.weight",
     ("layers", "post_attn_norm", "scale"), "copy"),
    ("model.layers.{i}.self_attn.q_proj.weight", ("layers", "attn", "q_proj"), "in_heads"),
    ("model.layers.{i}.self_attn.k_proj.weight", ("layers", "attn", "k_proj"), "in_heads"),
    ("model.layers.{i}.self_attn.v_proj.weight", ("layers", "attn", "v_proj"), "in_heads"),
    ("model.layers.{i}.self_attn.o_proj.weight", ("layers", "attn", "o_proj"), "out_heads"),
    ("model.layers.{i}.mlp.gate_proj.weight", ("layers", "mlp", "gate_proj"), "linear"),
    ("model.layers.{i}.mlp.up_proj.weight", ("layers", "mlp", "up_proj"), "linear"),
    ("model.layers.{i}.mlp.down_proj.weight", ("layers", "mlp", "down_proj"), "linear"),
)

_QKV_BIAS = (
    ("model.layers.{i}.self_attn.q_proj.bias", ("layers", "attn", "q_proj_bias"), "heads"),
    ("model.layers.{i}.self_attn.k_proj.bias", ("layers", "attn", "k_proj_bias"), "heads"),
    ("model.layers.{i}.self_attn.v_proj.bias", ("layers", "attn", "v_proj_bias"), "heads"),
)

_LM_HEAD = (("lm_head.weight", ("lm_head",), "linear"),)

# Qwen2 is Llama's layout; its q/k/v biases come in through `attention_bias`.
KEY_TABLES = {"llama": _LLAMA, "qwen2": _LLAMA}

# Tensors some checkpoints carry that hold no parameters of ours.
IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def key_table(cfg: config_lib.ModelConfig):
  """The rows that apply to `cfg` (bias rows only with bias, lm_head only if untied)."""
  rows = KEY_TABLES[cfg.model_type]
  if cfg.attention_bias:
    rows = rows + _QKV_BIAS
  if not cfg.tie_word_embeddings:
    rows = rows + _LM_HEAD
  return rows


def hf_names(template: str, num_layers: int) -> list[str]:
  if "{i}" not in template:
    return [template]
  return [template.format(i=i) for i in range(num_layers)]


def to_ours(hf_array: np.ndarray, layout: str, shape: tuple) -> np.ndarray:
  """Converts one HF tensor to our layout; `shape` is ours (without the layer axis)."""
  if layout in ("copy", "heads"):
    return hf_array.reshape(shape)
  if layout == "linear":
    return hf_array.T
  if layout in ("in_heads", "out_heads"):
    return hf_array.T.reshape(shape)
  raise ValueError(f"unknown layout {layout!r}")


def to_hf(our_array: np.ndarray, layout: str) -> np.ndarray:
  """Inverse of `to_ours`."""
  if layout == "copy":
    return our_array
  if layout == "heads":
    return our_array.reshape(-1)
  if layout == "linear":
    return our_array.T
  if layout == "in_heads":
    return our_array.reshape(our_array.shape[0], -1).T
  if layout == "out_heads":
    return our_array.reshape(-1, our_array.shape[-1]).T
  raise ValueError(f"unknown layout {layout!r}")
