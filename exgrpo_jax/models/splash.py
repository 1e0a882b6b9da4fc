"""Pallas splash attention (TPU) behind `models.attention`'s interface.

One splash MQA kernel per (batch row, KV head): the G query heads of a KV head share its
keys/values, so GQA needs no repeated K/V. Causality is the kernel's static mask; left
padding and packing are its segment ids (a valid query's segment never matches padding's
segment 0). Sequences are padded to whole 128-token blocks. The KV-cache prefill (queries
at a traced cache offset, which a static splash mask cannot express) runs `blockwise`.
`interpret=True` runs the kernel in Pallas's interpreter (CPU tests).
"""

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from exgrpo_jax.models import blockwise

_LANES = 128
BLOCK = 512


def _kernel(groups: int, length: int, interpret: bool):
  """The splash MQA kernel for `groups` query heads per KV head. Built in each trace, not
  cached: its mask tables are arrays of the trace that builds them (inside `shard_map`,
  values of that trace's mesh)."""
  block = math.gcd(BLOCK, length)
  sizes = kernel.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                            block_q_dkv=block, block_kv_dkv=block,
                            block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  causal = masks.MultiHeadMask([masks.CausalMask((length, length))] * groups)
  return kernel.make_splash_mqa_single_device(causal, block_sizes=sizes, interpret=interpret)


def attention(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask, interpret: bool = False):
  B, T, H, Dh = q_BxTxHxDh.shape
  K, S = k_BxKxDhxS.shape[1], k_BxKxDhxS.shape[3]
  if T != S:
    return blockwise.attention(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask)
  G = H // K
  Tp = -(-T // _LANES) * _LANES
  pad = lambda x, axis: jnp.pad(x, [(0, Tp - T) if a == axis else (0, 0)
                                    for a in range(x.ndim)])
  q_BxKxGxTxDh = pad(q_BxTxHxDh.reshape(B, T, K, G, Dh).transpose(0, 2, 3, 1, 4), 3)
  q_BxKxGxTxDh = q_BxKxGxTxDh / jnp.asarray(math.sqrt(Dh), q_BxTxHxDh.dtype)
  k_BxKxSxDh = pad(k_BxKxDhxS.transpose(0, 1, 3, 2), 2)
  v_BxKxSxDh = pad(v_BxKxSxDh, 2)
  kv_segment_BxS = pad(mask.kv_segment_BxS, 1)
  q_segment_BxT = kv_segment_BxS if mask.q_segment_BxT is None else pad(mask.q_segment_BxT, 1)
  splash = _kernel(G, Tp, interpret)

  def one_kv_head(q_GxTxDh, k_SxDh, v_SxDh, q_seg_T, kv_seg_S):
    return splash(q_GxTxDh, k_SxDh, v_SxDh, segment_ids=kernel.SegmentIds(q_seg_T, kv_seg_S))

  per_row = jax.vmap(one_kv_head, in_axes=(0, 0, 0, None, None))
  out = jax.vmap(per_row)(q_BxKxGxTxDh, k_BxKxSxDh, v_BxKxSxDh, q_segment_BxT, kv_segment_BxS)
  return out[:, :, :, :T].transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)
