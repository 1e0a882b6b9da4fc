"""The decode loop's decoder layer: the model's layer on one token per row, weights prepared.

`prepare` casts one layer's weights to the compute dtype once per `generate` call and
flattens o_proj to [H*Dh, D]; `step` runs the layer with the model's own RMSNorm, RoPE
and attention (`transformer`), so it computes what `transformer.DecoderLayer` computes.
The flat o_proj is what makes this faster than the model's layer: with its [H, Dh, D]
weight, XLA:CPU transposed that weight on every decode step (~2% of a SmolLM2 step at
batch 64). q/k/v stay separate matmuls (one [D, (H+2K)*Dh] matmul was no faster on CPU),
and so do gate and up: stacked into one [D, 2, F] matrix they cost a copy of 2/3 of the
weights per call and made a SmolLM2 step at batch 8 about 5% slower on CPU
(`scripts/bench/bench_sampler.py`), XLA:TPU copied that matrix into its matmul's tiling on
every decode chunk (1.8 GiB a chip of Qwen2.5-Math-7B's on a v5e-16, docs/aot.md), and
the model's own layer, which the engine prefills with on these arrays (`unprepare`),
took them apart again with strided copies.

The new key/value goes to one cache slot shared by every row (the static loop: an
in-place `dynamic_update_slice`, then attention over the whole [B, S] cache), or, in
continuous batching, whose rows are at different steps, into a pool of pages (`Paged`):
each row writes its own page slot (a scatter, in place) and attends only to the pages it
holds, so a young row does not pay for an old neighbour's keys. On TPU the pool is in
the ragged paged-attention kernel's layout and the kernel reads each row's live pages
(`paged_kernel`). Elsewhere attention over the pool is a softmax split over pages,
merged per row with segment sums (as split-K decoding kernels merge their blocks):
every page of the pool is read once, by its owner's queries.
"""

import math

import flax.struct
import jax
import jax.numpy as jnp

from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import transformer
from exgrpo_jax.sampling import paged_kernel


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
      gate_DxF=mlp["gate_proj"].astype(dt), up_DxF=mlp["up_proj"].astype(dt),
      down_FxD=mlp["down_proj"].astype(dt))


def unprepare(cfg, w):
  """`prepare`'s output in the model's layer form (`transformer.DecoderLayer`'s
  parameters), views of the prepared arrays: the engine keeps only the prepared weights
  and prefills with them (`decode.prefill`)."""
  names = ("q_proj", "k_proj", "v_proj")
  attn = {n: w[n] for n in names}
  if cfg.attention_bias:
    attn.update({n + "_bias": w[n + "_bias"] for n in names})
  attn["o_proj"] = w["o_ExD"].reshape(cfg.num_heads, cfg.head_dim, cfg.hidden_size)
  mlp = dict(gate_proj=w["gate_DxF"], up_proj=w["up_DxF"],
             down_proj=w["down_FxD"])
  return dict(input_norm=w["input_norm"], post_attn_norm=w["post_attn_norm"], attn=attn,
              mlp=mlp)


@flax.struct.dataclass
class Paged:
  """Where B rows write in a pool of P pages of T slots, and what they attend to."""

  page_B: jax.Array  # the page of the row's new key/value (P: the row writes nothing)
  offset_B: jax.Array  # its slot in that page
  owner_P: jax.Array  # the row that holds each page (B: a free page)
  mask_PxT: jax.Array  # the page slots its owner attends to
  table_BxN: jax.Array  # the row's pages (P: none), for the kernel
  length_B: jax.Array  # the addresses the row attends to, from 0, for the kernel


def step(cfg, w, x_BxD, cache_kv, positions_Bx1, mask_Bx1xS):
  """One token per row through one layer; returns (x_BxD, updated (k, v) cache).

  w: `prepare`'s output. cache_kv: (k_BxKxDhxS, v_BxKxSxDh, index) with index a scalar,
  the slot every row writes, and `mask_Bx1xS` the slots it attends to; or the page pool
  (k_PxKxDhxT, v_PxKxTxDh, `Paged`) or, in the kernel's layout, (kv_PxTxCxDh, `Paged`),
  and `mask_Bx1xS` None.
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
  attend = transformer.attend
  if isinstance(cache_kv[-1], Paged):
    attend = _attend_paged if len(cache_kv) == 3 else _attend_kernel
  out_Bx1xHxDh, new_kv = attend(
      transformer.apply_rope(project("q_proj"), positions_Bx1, inv_freq),
      transformer.apply_rope(project("k_proj"), positions_Bx1, inv_freq), project("v_proj"),
      mask_Bx1xS, cache_kv)
  x_BxD = x_BxD + jnp.einsum("be,ed->bd", out_Bx1xHxDh.reshape(B, -1), w["o_ExD"])
  y_BxD = norm(w["post_attn_norm"], x_BxD)
  h_BxF = (jax.nn.silu(jnp.einsum("bd,df->bf", y_BxD, w["gate_DxF"]))
           * jnp.einsum("bd,df->bf", y_BxD, w["up_DxF"]))
  return x_BxD + jnp.einsum("bf,fd->bd", h_BxF, w["down_FxD"]), new_kv


def _attend_paged(q_Bx1xHxDh, k_Bx1xKxDh, v_Bx1xKxDh, mask, cache_kv):
  """`transformer.attend` over a page pool: each row's new key/value goes to its page
  slot, and each row attends to the unmasked slots of the pages it owns."""
  del mask  # in `paged`
  k_PxKxDhxT, v_PxKxTxDh, paged = cache_kv
  k_PxKxDhxT = k_PxKxDhxT.at[paged.page_B, :, :, paged.offset_B].set(k_Bx1xKxDh[:, 0],
                                                                      mode="drop")
  v_PxKxTxDh = v_PxKxTxDh.at[paged.page_B, :, paged.offset_B].set(v_Bx1xKxDh[:, 0],
                                                                   mode="drop")
  out_BxHxDh = paged_attention(q_Bx1xHxDh[:, 0], k_PxKxDhxT, v_PxKxTxDh, paged.owner_P,
                               paged.mask_PxT)
  return out_BxHxDh[:, None], (k_PxKxDhxT, v_PxKxTxDh)


def _attend_kernel(q_Bx1xHxDh, k_Bx1xKxDh, v_Bx1xKxDh, mask, cache_kv):
  """`_attend_paged` with the pool in the kernel's layout (`paged_kernel`)."""
  del mask  # in `paged`
  kv_PxTxCxDh, paged = cache_kv
  out_BxHxDh, kv_PxTxCxDh = paged_kernel.attend(
      q_Bx1xHxDh[:, 0], k_Bx1xKxDh[:, 0], v_Bx1xKxDh[:, 0], kv_PxTxCxDh, paged.page_B,
      paged.offset_B, paged.table_BxN, paged.length_B)
  return out_BxHxDh[:, None], (kv_PxTxCxDh,)


def paged_attention(q_BxHxDh, k_PxKxDhxT, v_PxKxTxDh, owner_P, mask_PxT):
  """Grouped-query attention of B queries over a pool of P pages, each read by its owner.

  Scores per page, then the softmax merged per row: its max and its sum over the row's
  pages (segment ops; pages owned by no row, owner >= B, drop out). Computes what
  `models.attention.einsum_attention` computes over the row's unmasked slots, in another
  summation order. Every row must have at least one unmasked slot.
  """
  dt = q_BxHxDh.dtype
  B, H, Dh = q_BxHxDh.shape
  K = k_PxKxDhxT.shape[1]
  q_PxKxGxDh = q_BxHxDh.reshape(B, K, H // K, Dh)[jnp.minimum(owner_P, B - 1)]
  scores_PxKxGxT = jnp.einsum("pkgd,pkdt->pkgt", q_PxKxGxDh, k_PxKxDhxT,
                              preferred_element_type=jnp.float32) / math.sqrt(Dh)
  mask_Px1x1xT = mask_PxT[:, None, None]
  max_BxKxG = jax.ops.segment_max(
      jnp.max(jnp.where(mask_Px1x1xT, scores_PxKxGxT, -jnp.inf), axis=-1), owner_P,
      num_segments=B)
  weights_PxKxGxT = jnp.where(
      mask_Px1x1xT,
      jnp.exp(scores_PxKxGxT - max_BxKxG[jnp.minimum(owner_P, B - 1)][..., None]), 0.0)
  sum_BxKxG = jax.ops.segment_sum(jnp.sum(weights_PxKxGxT, axis=-1), owner_P,
                                  num_segments=B)
  out_PxKxGxDh = jnp.einsum("pkgt,pktd->pkgd", weights_PxKxGxT.astype(dt), v_PxKxTxDh,
                            preferred_element_type=jnp.float32)
  out_BxKxGxDh = jax.ops.segment_sum(out_PxKxGxDh, owner_P, num_segments=B)
  return (out_BxKxGxDh / sum_BxKxG[..., None]).astype(dt).reshape(B, H, Dh)
