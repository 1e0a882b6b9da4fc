"""Memory-efficient attention in pure JAX: online softmax over key blocks, custom VJP.

The forward visits, for each block of `block` queries, the key blocks at or below the
causal diagonal, keeping a running max `m`, normaliser `l` and output accumulator per
query (FlashAttention's recurrence); it saves only the output and the log-sum-exp of each
query. The backward recomputes one [block x block] tile of scores at a time from those,
walking key blocks (outer) and the query blocks that can see them (inner), accumulating
dK/dV for the key block and adding into a dQ array of the queries' size. So memory is
O((T + S) x H x Dh) plus one tile of scores per (batch, head), in both passes, and the
skipped upper triangle halves the FLOPs of a causal self-attention.

Layouts: queries are regrouped per KV head as rows m = (group member g, position t), so
each tile is a [G*bq, Dh] x [Dh, bk] matmul batched over (batch, KV head), like the
einsum reference. T and S are padded up to whole blocks with masked queries/keys.
A query that may attend to nothing (padding) gets a zero output and zero gradients.
"""

import functools
import math

import jax
import jax.numpy as jnp

BLOCK = 512
_NEG_INF = float(jnp.finfo(jnp.float32).min)


def _pad_to(x, axis, size):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def attention(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask, block: int | None = None):
  """Same result as `attention.einsum_attention` on the mask's valid queries."""
  block = block or BLOCK
  B, T, H, Dh = q_BxTxHxDh.shape
  K, S = k_BxKxDhxS.shape[1], k_BxKxDhxS.shape[3]
  G = H // K
  bq, bk = min(block, T), min(block, S)
  Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
  q_BxKxGxTxDh = _pad_to(q_BxTxHxDh.reshape(B, T, K, G, Dh).transpose(0, 2, 3, 1, 4), 3, Tp)
  # Padded keys have segment 0 (never attended); padded queries are sliced off below.
  mask = mask.replace(
      kv_segment_BxS=_pad_to(mask.kv_segment_BxS, 1, Sp),
      q_segment_BxT=None if mask.q_segment_BxT is None else _pad_to(mask.q_segment_BxT, 1, Tp))
  out = _flash(bq, bk, q_BxKxGxTxDh, _pad_to(k_BxKxDhxS, 3, Sp), _pad_to(v_BxKxSxDh, 2, Sp),
               mask)
  return out[:, :, :, :T].transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)


def _q_tile(x_BxKxGxTxD, i, bq):
  B, K, G, _, D = x_BxKxGxTxD.shape
  tile = jax.lax.dynamic_slice_in_dim(x_BxKxGxTxD, i * bq, bq, axis=3)
  return tile.reshape(B, K, G * bq, D)


def _row_tile(x_BxKxGxT, i, bq):
  B, K, G, _ = x_BxKxGxT.shape
  return jax.lax.dynamic_slice_in_dim(x_BxKxGxT, i * bq, bq, axis=3).reshape(B, K, G * bq)


def _scores(q_BxKxMxDh, k_BxKxDhxS, mask, i, j, bq, bk):
  """One tile of scaled scores [B, K, G*bq, bk] and its mask (broadcast over K)."""
  B, K, M, Dh = q_BxKxMxDh.shape
  k_tile = jax.lax.dynamic_slice_in_dim(k_BxKxDhxS, j * bk, bk, axis=3)
  s = jnp.einsum("bkmd,bkds->bkms", q_BxKxMxDh, k_tile,
                 preferred_element_type=jnp.float32) / math.sqrt(Dh)
  allowed_Bx1xGxbqxbk = jnp.broadcast_to(mask.block(i * bq, bq, j * bk, bk)[:, None, None],
                                         (B, 1, M // bq, bq, bk))
  return s, allowed_Bx1xGxbqxbk.reshape(B, 1, M, bk)


def _kv_end(mask, i, bq, bk, nk):
  """Key blocks [0, end) hold a slot at or before query block i's last query."""
  return jnp.clip((mask.q_offset + (i + 1) * bq - 1) // bk + 1, 0, nk)


def _q_start(mask, j, bq, bk, nq):
  """Query blocks [start, nq) hold a query at or after key block j's first slot."""
  return jnp.clip((j * bk - mask.q_offset) // bq, 0, nq)


def _forward(bq, bk, q, k_BxKxDhxS, v_BxKxSxDh, mask):
  B, K, G, T, Dh = q.shape
  nq, nk = T // bq, k_BxKxDhxS.shape[3] // bk
  dt = q.dtype

  def q_block(i):
    q_tile = _q_tile(q, i, bq)

    def kv_step(j, carry):
      m, l, acc = carry
      s, allowed = _scores(q_tile, k_BxKxDhxS, mask, i, j, bq, bk)
      s = jnp.where(allowed, s, _NEG_INF)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
      rescale = jnp.exp(m - m_new)
      v_tile = jax.lax.dynamic_slice_in_dim(v_BxKxSxDh, j * bk, bk, axis=2)
      pv = jnp.einsum("bkms,bksd->bkmd", p.astype(dt), v_tile,
                      preferred_element_type=jnp.float32)
      return m_new, l * rescale + p.sum(-1), acc * rescale[..., None] + pv

    M = G * bq
    init = (jnp.full((B, K, M), _NEG_INF), jnp.zeros((B, K, M)), jnp.zeros((B, K, M, Dh)))
    m, l, acc = jax.lax.fori_loop(0, _kv_end(mask, i, bq, bk, nk), kv_step, init)
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    return out.astype(dt).reshape(B, K, G, bq, Dh), lse.reshape(B, K, G, bq)

  out_N, lse_N = jax.lax.map(q_block, jnp.arange(nq))
  out = jnp.moveaxis(out_N, 0, 3).reshape(B, K, G, T, Dh)
  lse = jnp.moveaxis(lse_N, 0, 3).reshape(B, K, G, T)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(bq, bk, q, k_BxKxDhxS, v_BxKxSxDh, mask):
  return _forward(bq, bk, q, k_BxKxDhxS, v_BxKxSxDh, mask)[0]


def _flash_fwd(bq, bk, q, k_BxKxDhxS, v_BxKxSxDh, mask):
  out, lse = _forward(bq, bk, q, k_BxKxDhxS, v_BxKxSxDh, mask)
  return out, (q, k_BxKxDhxS, v_BxKxSxDh, mask, out, lse)


def _flash_bwd(bq, bk, residuals, d_out):
  q, k_BxKxDhxS, v_BxKxSxDh, mask, out, lse = residuals
  B, K, G, T, Dh = q.shape
  nq, nk = T // bq, k_BxKxDhxS.shape[3] // bk
  dt = q.dtype
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

  def kv_block(dq, j):
    k_tile = jax.lax.dynamic_slice_in_dim(k_BxKxDhxS, j * bk, bk, axis=3)
    v_tile = jax.lax.dynamic_slice_in_dim(v_BxKxSxDh, j * bk, bk, axis=2)

    def q_step(i, carry):
      dq, dk, dv = carry
      q_tile, do_tile = _q_tile(q, i, bq), _q_tile(d_out, i, bq)
      s, allowed = _scores(q_tile, k_BxKxDhxS, mask, i, j, bq, bk)
      p = jnp.where(allowed, jnp.exp(s - _row_tile(lse, i, bq)[..., None]), 0.0)
      dv += jnp.einsum("bkms,bkmd->bksd", p.astype(dt), do_tile,
                       preferred_element_type=jnp.float32)
      dp = jnp.einsum("bkmd,bksd->bkms", do_tile, v_tile, preferred_element_type=jnp.float32)
      ds = (p * (dp - _row_tile(delta, i, bq)[..., None])).astype(dt)
      dk += jnp.einsum("bkms,bkmd->bkds", ds, q_tile, preferred_element_type=jnp.float32)
      dq_tile = jnp.einsum("bkms,bkds->bkmd", ds, k_tile,
                           preferred_element_type=jnp.float32).reshape(B, K, G, bq, Dh)
      dq = jax.lax.dynamic_update_slice_in_dim(
          dq, jax.lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=3) + dq_tile, i * bq, axis=3)
      return dq, dk, dv

    init = (dq, jnp.zeros((B, K, Dh, bk)), jnp.zeros((B, K, bk, Dh)))
    dq, dk, dv = jax.lax.fori_loop(_q_start(mask, j, bq, bk, nq), nq, q_step, init)
    return dq, (dk, dv)

  dq, (dk_N, dv_N) = jax.lax.scan(kv_block, jnp.zeros((B, K, G, T, Dh)), jnp.arange(nk))
  scale = 1 / math.sqrt(Dh)
  dk = jnp.moveaxis(dk_N, 0, 3).reshape(B, K, Dh, nk * bk) * scale
  dv = jnp.moveaxis(dv_N, 0, 2).reshape(B, K, nk * bk, Dh)
  mask_zeros = jax.tree.map(lambda x: None, mask)
  return (dq * scale).astype(dt), dk.astype(dt), dv.astype(dt), mask_zeros


_flash.defvjp(_flash_fwd, _flash_bwd)
