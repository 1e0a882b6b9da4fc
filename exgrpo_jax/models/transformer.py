"""The decoder-only policy model (Llama / Qwen2 / SmolLM2) in Flax Linen.

Why Linen and not NNX: parameters are a plain nested dict, so the HF key table, optax,
Orbax, the sharding rules and the sampler's weight hand-off all work on one ordinary
pytree, and the jitted train step is a pure function of (params, batch). Every parameter
carries logical axis names (`embed`, `mlp`, `heads`, `kv_heads`, `head_dim`, `vocab`,
`norm`, `layers`); `exgrpo_jax.sharding` maps them to a device mesh. Layers are stacked
with `nn.scan` (one compiled layer body, fast compiles for 30+ layers) and optionally
rematerialised.

Attention takes an explicit `KVCache` so the sampler can prefill and decode with the same
module the learner trains; without a cache it is ordinary causal self-attention over the
valid tokens of a (left- or right-) padded batch, or within the segments of packed rows.
The attention kernel is `cfg.attention` (`models/attention.py`); the sampler's decode
step keeps the einsum (`attend`), faster than blockwise for one query per row.
"""

import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from exgrpo_jax.models import attention as attention_lib
from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import quant


@flax.struct.dataclass
class KVCache:
  """Keys/values of every layer for S slots, and which slots hold real tokens.

  k_LxBxKxDhxS, v_LxBxKxSxDh: cached keys (transposed) and values, in the compute
    dtype, laid out so both attention matmuls read them as plain [Dh, S] and [S, Dh]
    operands per (batch, kv head), with no transpose of the cache.
  valid_BxS: True where a slot holds a real (non-padding) token.
  index: the next slot to write (same for the whole batch).
  """

  k_LxBxKxDhxS: jax.Array
  v_LxBxKxSxDh: jax.Array
  valid_BxS: jax.Array
  index: jax.Array

  @classmethod
  def zeros(cls, cfg: config_lib.ModelConfig, batch: int, slots: int) -> "KVCache":
    L, K, Dh = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    dtype = config_lib.dtype_from_name(cfg.dtype)
    return cls(jnp.zeros((L, batch, K, Dh, slots), dtype),
               jnp.zeros((L, batch, K, slots, Dh), dtype),
               jnp.zeros((batch, slots), bool), jnp.zeros((), jnp.int32))


def cache_positions(valid_BxS: jax.Array, index: jax.Array, valid_BxT: jax.Array):
  """For T tokens written at cache slot `index`: (slot validity after the write, their
  positions [B, T])."""
  valid_BxS = jax.lax.dynamic_update_slice_in_dim(valid_BxS, valid_BxT, index, axis=1)
  positions_BxS = jnp.maximum(jnp.cumsum(valid_BxS, axis=1) - 1, 0)
  positions_BxT = jax.lax.dynamic_slice_in_dim(positions_BxS, index, valid_BxT.shape[1],
                                               axis=1)
  return valid_BxS, positions_BxT


def cache_positions_and_mask(valid_BxS: jax.Array, index: jax.Array, valid_BxT: jax.Array):
  """`cache_positions` and the tokens' attention mask over the slots [B, T, S]."""
  valid_BxS, positions_BxT = cache_positions(valid_BxS, index, valid_BxT)
  mask = attention_lib.AttentionMask.padded(valid_BxS, index)
  return valid_BxS, positions_BxT, mask.dense(valid_BxT.shape[1])


def segment_positions(segment_ids_BxT: jax.Array) -> jax.Array:
  """Each token's offset from the start of its segment (a run of equal segment ids)."""
  t_T = jnp.arange(segment_ids_BxT.shape[1])
  starts_BxT = jnp.concatenate(
      [jnp.ones_like(segment_ids_BxT[:, :1], bool),
       segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)
  start_BxT = jax.lax.cummax(jnp.where(starts_BxT, t_T, 0), axis=1)
  return t_T - start_BxT


def rope_inv_freq(cfg: config_lib.ModelConfig) -> jax.Array:
  """RoPE inverse frequencies [Dh/2], with the llama3 long-context rule if configured."""
  dh = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  scaling = cfg.rope_scaling_dict
  if not scaling:
    return inv_freq
  factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
  old_len = scaling["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv_freq
  # Long wavelengths are slowed down by `factor`, short ones kept, the band between
  # them interpolated smoothly (Llama 3.1 release).
  scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  interpolated = (1 - smooth) * scaled / factor + smooth * scaled
  in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return jnp.where(in_band, interpolated, scaled)


def apply_rope(x_BxTxNxDh, positions_BxT, inv_freq):
  """Rotates the two halves of each head (the HF `rotate_half` convention)."""
  angles_BxTxF = positions_BxT[..., None].astype(jnp.float32) * inv_freq
  cos = jnp.concatenate([jnp.cos(angles_BxTxF)] * 2, axis=-1)[:, :, None, :]
  sin = jnp.concatenate([jnp.sin(angles_BxTxF)] * 2, axis=-1)[:, :, None, :]
  x1, x2 = jnp.split(x_BxTxNxDh, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  dtype = x_BxTxNxDh.dtype
  return x_BxTxNxDh * cos.astype(dtype) + rotated * sin.astype(dtype)


def write_cache(k_BxTxKxDh, v_BxTxKxDh, cache_kv):
  """New keys/values in the cache layout, written at slot `index` if `cache_kv` =
  (k_BxKxDhxS, v_BxKxSxDh, index) is given; returns (k_BxKxDhxS, v_BxKxSxDh)."""
  k_BxKxDhxT = k_BxTxKxDh.transpose(0, 2, 3, 1)
  v_BxKxTxDh = v_BxTxKxDh.transpose(0, 2, 1, 3)
  if cache_kv is None:
    return k_BxKxDhxT, v_BxKxTxDh
  cache_k, cache_v, index = cache_kv
  return (jax.lax.dynamic_update_slice_in_dim(cache_k, k_BxKxDhxT, index, axis=3),
          jax.lax.dynamic_update_slice_in_dim(cache_v, v_BxKxTxDh, index, axis=2))


def attend(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, mask_BxTxS, cache_kv):
  """The einsum attention with an explicit mask, for the sampler's decode step.

  With `cache_kv` = (k_BxKxDhxS, v_BxKxSxDh, index) the new keys/values are first written
  at slot `index` and the queries attend to all S slots (through the mask); returns
  (out_BxTxHxDh, updated (k, v) cache or None).
  """
  k_BxKxDhxS, v_BxKxSxDh = write_cache(k_BxTxKxDh, v_BxTxKxDh, cache_kv)
  out_BxTxHxDh = attention_lib.einsum_attention(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh,
                                                mask_BxTxS)
  return out_BxTxHxDh, None if cache_kv is None else (k_BxKxDhxS, v_BxKxSxDh)


def _param(module, name, init, shape, axes, dtype):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def _matmul(equation: str, x, w, dtype):
  """The einsum of `x` and weight `w` in `dtype`. A quantized weight (a QLoRA base's,
  `models.quant`) is dequantized here, inside its layer, and dequantized again in the
  backward pass rather than kept: kept, every layer's dequantized weights would stack
  up as the scan's residuals, a full-precision copy of the whole base."""
  if not quant.is_quantized(w):
    return jnp.einsum(equation, x, w.astype(dtype))
  return jax.checkpoint(
      lambda x, w: jnp.einsum(equation, x, quant.dequantize(w).astype(dtype)))(x, w)


def _with_lora(module, name, y, x, contract: str, dtype):
  """`y` (x through weight `name`) plus the low-rank update (x @ A) @ B where the params
  carry `name`'s adapter (`models.lora.for_forward`; B comes scaled), else `y` as is.
  `contract` is the einsum of x with A, e.g. "btd,dr->btr"."""
  if not module.has_variable("params", name + "_lora_a"):
    return y
  a = module.get_variable("params", name + "_lora_a").astype(dtype)
  b = module.get_variable("params", name + "_lora_b").astype(dtype)
  low_BxTxr = jnp.einsum(contract, x, a)
  return y + jnp.tensordot(low_BxTxr, b, axes=1)


class RMSNorm(nn.Module):
  cfg: config_lib.ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD):
    cfg = self.cfg
    scale_D = _param(self, "scale", nn.initializers.ones, (cfg.hidden_size,), ("norm",),
                     config_lib.dtype_from_name(cfg.param_dtype))
    x32 = x_BxTxD.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    dtype = config_lib.dtype_from_name(cfg.dtype)
    return scale_D.astype(dtype) * x32.astype(dtype)


class Attention(nn.Module):
  """Grouped-query attention with RoPE, optional q/k/v bias and an optional KV cache."""

  cfg: config_lib.ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, mask: attention_lib.AttentionMask, cache_kv):
    cfg = self.cfg
    pdt = config_lib.dtype_from_name(cfg.param_dtype)
    dt = config_lib.dtype_from_name(cfg.dtype)
    D, H, K, Dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    init = nn.initializers.normal(0.02)

    def project(name, n_heads, head_axis):
      w = _param(self, name, init, (D, n_heads, Dh), ("embed", head_axis, "head_dim"), pdt)
      y = _with_lora(self, name, _matmul("btd,dnh->btnh", x_BxTxD, w, dt),
                     x_BxTxD, "btd,dr->btr", dt)
      if cfg.attention_bias:
        b = _param(self, name + "_bias", nn.initializers.zeros, (n_heads, Dh),
                   (head_axis, "head_dim"), pdt)
        y = y + b.astype(dt)
      return y

    inv_freq = rope_inv_freq(cfg)
    q_BxTxHxDh = apply_rope(project("q_proj", H, "heads"), positions_BxT, inv_freq)
    k_BxTxKxDh = apply_rope(project("k_proj", K, "kv_heads"), positions_BxT, inv_freq)
    v_BxTxKxDh = project("v_proj", K, "kv_heads")

    k_BxKxDhxS, v_BxKxSxDh = write_cache(k_BxTxKxDh, v_BxTxKxDh, cache_kv)
    out_BxTxHxDh = attention_lib.attend(cfg.attention, q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh,
                                        mask)
    new_kv = None if cache_kv is None else (k_BxKxDhxS, v_BxKxSxDh)
    w_o = _param(self, "o_proj", init, (H, Dh, D), ("heads", "head_dim", "embed"), pdt)
    out_BxTxD = _with_lora(self, "o_proj",
                           _matmul("bthd,hde->bte", out_BxTxHxDh, w_o, dt),
                           out_BxTxHxDh, "bthd,hdr->btr", dt)
    return out_BxTxD, new_kv


class MLP(nn.Module):
  cfg: config_lib.ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD):
    cfg = self.cfg
    pdt = config_lib.dtype_from_name(cfg.param_dtype)
    dt = config_lib.dtype_from_name(cfg.dtype)
    D, F = cfg.hidden_size, cfg.intermediate_size
    init = nn.initializers.normal(0.02)
    gate = _param(self, "gate_proj", init, (D, F), ("embed", "mlp"), pdt)
    up = _param(self, "up_proj", init, (D, F), ("embed", "mlp"), pdt)
    down = _param(self, "down_proj", init, (F, D), ("mlp", "embed"), pdt)
    proj = lambda name, w, x, matmul, contract: _with_lora(
        self, name, _matmul(matmul, x, w, dt), x, contract, dt)
    h_BxTxF = (nn.silu(proj("gate_proj", gate, x_BxTxD, "btd,df->btf", "btd,dr->btr"))
               * proj("up_proj", up, x_BxTxD, "btd,df->btf", "btd,dr->btr"))
    return proj("down_proj", down, h_BxTxF, "btf,fd->btd", "btf,fr->btr")


class DecoderLayer(nn.Module):
  """Pre-norm block; the scan carry is the residual stream, the scanned input the cache."""

  cfg: config_lib.ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD, layer_cache, positions_BxT, mask):
    attn_out, new_kv = Attention(self.cfg, name="attn")(
        RMSNorm(self.cfg, name="input_norm")(x_BxTxD), positions_BxT, mask, layer_cache)
    x_BxTxD = x_BxTxD + attn_out
    x_BxTxD = x_BxTxD + MLP(self.cfg, name="mlp")(
        RMSNorm(self.cfg, name="post_attn_norm")(x_BxTxD))
    return x_BxTxD, new_kv


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Transformer(nn.Module):
  """Embedding, L scanned decoder layers, final norm and (tied or untied) LM head."""

  cfg: config_lib.ModelConfig

  def setup(self):
    cfg = self.cfg
    pdt = config_lib.dtype_from_name(cfg.param_dtype)
    self.embedding_VxD = _param(self, "embed", nn.initializers.normal(0.02),
                                (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pdt)
    if not cfg.tie_word_embeddings:
      self.lm_head_DxV = _param(self, "lm_head", nn.initializers.normal(0.02),
                                (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pdt)
    layer_cls = DecoderLayer
    if cfg.remat != "none":
      layer_cls = nn.remat(layer_cls, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
    self.layers = nn.scan(
        layer_cls,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast, nn.broadcast),
        length=cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(cfg, name="layers")
    self.final_norm = RMSNorm(cfg)

  def unembedding(self):
    """The [D, V] matrix that maps final hidden states to logits."""
    return self.embedding_VxD.T if self.cfg.tie_word_embeddings else self.lm_head_DxV

  def __call__(self, tokens_BxT, valid_BxT=None, cache: KVCache | None = None,
               return_hidden: bool = False, *, positions_BxT=None, segment_ids_BxT=None):
    """Runs the decoder.

    Args:
      tokens_BxT: int token ids.
      valid_BxT: bool, False on padding (default: all valid). Positions count valid
        tokens only, so left padding does not shift a prompt's positions.
      cache: if given, the T tokens are written at slots [index, index+T) and attend to
        every valid earlier slot; the updated cache is returned.
      return_hidden: return final-norm hidden states [B, T, D] instead of logits.
      positions_BxT: int RoPE positions, overriding the default (count of valid tokens,
        or the offset within the segment when `segment_ids_BxT` is given).
      segment_ids_BxT: int, for rows packing several sequences: 0 on padding, 1, 2, ...
        for the sequence a token belongs to. Tokens attend causally within their own
        segment only; replaces `valid_BxT`. Not supported with a cache.

    Returns:
      (float32 logits [B, T, V] or hidden states, updated cache or None).
    """
    cfg = self.cfg
    dt = config_lib.dtype_from_name(cfg.dtype)
    if valid_BxT is None:
      valid_BxT = jnp.ones(tokens_BxT.shape, bool)
    B, T = tokens_BxT.shape
    x_BxTxD = jnp.take(self.embedding_VxD, tokens_BxT, axis=0).astype(dt)

    if cache is None:
      if segment_ids_BxT is None:
        default_positions_BxT = jnp.maximum(jnp.cumsum(valid_BxT, axis=1) - 1, 0)
        mask = attention_lib.AttentionMask.padded(valid_BxT)
      else:
        default_positions_BxT = segment_positions(segment_ids_BxT)
        mask = attention_lib.AttentionMask.packed(segment_ids_BxT)
      layer_caches, new_cache = None, None
    else:
      if segment_ids_BxT is not None:
        raise ValueError("segment_ids_BxT (packed rows) is not supported with a KV cache")
      valid_BxS, default_positions_BxT = cache_positions(cache.valid_BxS, cache.index,
                                                         valid_BxT)
      mask = attention_lib.AttentionMask.padded(valid_BxS, cache.index)
      layer_caches = (cache.k_LxBxKxDhxS, cache.v_LxBxKxSxDh,
                      jnp.broadcast_to(cache.index, (cfg.num_layers,)))

    if positions_BxT is None:
      positions_BxT = default_positions_BxT
    x_BxTxD, new_kv = self.layers(x_BxTxD, layer_caches, positions_BxT, mask)
    if cache is not None:
      new_cache = KVCache(new_kv[0], new_kv[1], valid_BxS, cache.index + T)
    h_BxTxD = self.final_norm(x_BxTxD)
    if return_hidden:
      return h_BxTxD, new_cache
    logits_BxTxV = jnp.einsum("btd,dv->btv", h_BxTxD, self.unembedding().astype(dt),
                              preferred_element_type=jnp.float32)
    return logits_BxTxV, new_cache
