"""The decode loop's decoder layer: the model's layer on one token per row, weights prepared.

`prepare` casts one layer's weights to the compute dtype once per `generate` call,
stacks gate/up into one [D, 2, F] matrix (one matmul instead of two) and flattens
o_proj to [H*Dh, D]; `step` runs the layer with the model's own RMSNorm, RoPE and
attention (`transformer`), so it computes what `transformer.DecoderLayer` computes. The
flat o_proj is what makes this faster than the model's layer: with its [H, Dh, D]
weight, XLA:CPU transposed that weight on every decode step (~2% of a SmolLM2 step at
batch 64). q/k/v stay separate matmuls (one [D, (H+2K)*Dh] matmul was no faster on CPU),
and gate/up are stacked on a new axis rather than concatenated, so that under tensor
parallelism each device's part of the product lines up with its shard of F.

The new key/value goes to one cache slot shared by every row (the static loop: an
in-place `dynamic_update_slice`) or to one slot per row (continuous batching, whose rows
are at different steps: a scatter of B x K x Dh values, also in place).
"""

import jax
import jax.numpy as jnp

from exgrpo_jax.models import attention as attention_lib
from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import transformer


def prepare(cfg, layer_params):
  """One layer's parameters (a slice of params["layers"]) in the form `step` takes."""
  dt = config_lib.dtype_from_name(cfg.dtype)
  D, H, Dh = cfg.hidden_size, cfg.num_heads, cfg.head_dim
  attn, mlp = layer_params["attn"], layer_params["mlp"]
  prepared = {name: attn[name].astype(dt) for name in ("q_proj", "k_proj", "v_proj")}
  if cfg.attention_bias:
    prepared.update({n + "_bias": attn[n + "_bias"].astype(dt)
                     for n in ("q_proj", "k_proj", "v_proj")})
  return dict(
      prepared, input_norm=layer_params["input_norm"],
      post_attn_norm=layer_params["post_attn_norm"],
      o_ExD=attn["o_proj"].reshape(H * Dh, D).astype(dt),
      gate_up_Dx2xF=jnp.stack([mlp["gate_proj"], mlp["up_proj"]], axis=1).astype(dt),
      down_FxD=mlp["down_proj"].astype(dt))


def step(cfg, w, x_BxD, cache_kv, positions_Bx1, mask_Bx1xS):
  """One token per row through one layer; returns (x_BxD, updated (k, v) cache).

  w: `prepare`'s output. cache_kv: (k_BxKxDhxS, v_BxKxSxDh, index), index a scalar (the
  slot of every row) or int32 [B] (each row's slot; out of range: the row writes nothing).
  """
  B = x_BxD.shape[0]
  norm = lambda scale, x: transformer.RMSNorm(cfg).apply({"params": scale}, x)
  h_BxD = norm(w["input_norm"], x_BxD)

  def project(name):
    y_BxNxDh = jnp.einsum("bd,dnh->bnh", h_BxD, w[name])
    if cfg.attention_bias:
      y_BxNxDh = y_BxNxDh + w[name + "_bias"]
    return y_BxNxDh[:, None]

  inv_freq = transformer.rope_inv_freq(cfg)
  attend = transformer.attend if jnp.ndim(cache_kv[2]) == 0 else _attend_per_row
  out_Bx1xHxDh, new_kv = attend(
      transformer.apply_rope(project("q_proj"), positions_Bx1, inv_freq),
      transformer.apply_rope(project("k_proj"), positions_Bx1, inv_freq), project("v_proj"),
      mask_Bx1xS, cache_kv)
  x_BxD = x_BxD + jnp.einsum("be,ed->bd", out_Bx1xHxDh.reshape(B, -1), w["o_ExD"])
  gate_up_Bx2xF = jnp.einsum("bd,dcf->bcf", norm(w["post_attn_norm"], x_BxD),
                             w["gate_up_Dx2xF"])
  h_BxF = jax.nn.silu(gate_up_Bx2xF[:, 0]) * gate_up_Bx2xF[:, 1]
  return x_BxD + jnp.einsum("bf,fd->bd", h_BxF, w["down_FxD"]), new_kv


def _attend_per_row(q_Bx1xHxDh, k_Bx1xKxDh, v_Bx1xKxDh, mask_Bx1xS, cache_kv):
  """`transformer.attend` with the new key/value written at each row's own slot."""
  k_BxKxDhxS, v_BxKxSxDh, index_B = cache_kv
  b_B = jnp.arange(q_Bx1xHxDh.shape[0])
  k_BxKxDhxS = k_BxKxDhxS.at[b_B, :, :, index_B].set(k_Bx1xKxDh[:, 0], mode="drop")
  v_BxKxSxDh = v_BxKxSxDh.at[b_B, :, index_B].set(v_Bx1xKxDh[:, 0], mode="drop")
  out_Bx1xHxDh = attention_lib.einsum_attention(q_Bx1xHxDh, k_BxKxDhxS, v_BxKxSxDh,
                                                mask_Bx1xS)
  return out_Bx1xHxDh, (k_BxKxDhxS, v_BxKxSxDh)
