"""Decode attention over the page pool with the ragged paged-attention kernel (TPU).

On TPU the pool of each layer is one array in the kernel's layout, kv_PxTxCxDh: P pages
of T slots, C = 2K combined heads (key of KV head k at 2k, its value at 2k + 1), head
dim Dh; elsewhere it stays a (k_PxKxDhxT, v_PxKxTxDh) pair for `decode_layer`'s XLA
attention. XLA:TPU copied that pair into (page, slot, head, dim) order, and back, around
every decode loop (18 GiB of Llama-3.1-8B's 26.7 GiB of temporaries at 64 rows on a
v5p-8, docs/aot.md "Memory plan"); XLA:GPU updates it in place and would copy this layout
instead. So the layout follows the platform (`wanted`), as `models.attention` chooses
its fused kernels from the mesh's.

Each decode step writes the rows' new keys/values into their page slots and calls
`jax.experimental.pallas.ops.tpu.ragged_paged_attention` with one query per row, the
row's pages (the page table, `pages.PageTable`) and its length (position + 1): the
kernel reads only the live pages of each row. XLA cannot partition a Mosaic kernel, so
on a mesh both run inside `shard_map`: rows and pages over the batch axes (a row's
pages are on its own device, `pages.PageTable`), KV heads over `tensor`.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

from exgrpo_jax import sharding

P = jax.sharding.PartitionSpec
# Keys per kernel block (`num_kv_pages_per_block` x T) and queries per block: the kernel's
# tuned table's most common v5 choice for pages of 64, 16 pages and 32 queries (JAX looks
# it up from the attached TPU, which an ahead-of-time compile on a CPU host has not).
# A block holds at most _BLOCK_BYTES of keys and values (that choice's for 2 KV heads of
# 128 in bfloat16), so more heads on a device take fewer pages: at 16 pages, 8 KV heads
# (Llama-3.1-8B at tensor 1) and two blocks of queries the kernel needed 16.12 MiB of
# Mosaic's 16 MiB of scoped VMEM.
_BLOCK_KEYS = 1024
_BLOCK_BYTES = 2 ** 20
_BLOCK_QUERIES = 32


def wanted(cfg, mesh, slots: int) -> bool:
  """Whether the pool takes the kernel's layout: on TPU, for a head dim of a multiple of
  128 lanes, with the slots split evenly over the mesh's batch axes."""
  platform = (jax.default_backend() if mesh is None
              else mesh.devices.flat[0].platform)
  shards = sharding.batch_shards(mesh)
  return platform == "tpu" and cfg.head_dim % 128 == 0 and slots % shards == 0


def empty_layer(pages: int, page_size: int, kv_heads: int, head_dim: int, dtype):
  return (jnp.zeros((pages, page_size, 2 * kv_heads, head_dim), dtype),)


def pool_spec(mesh, shape) -> P:
  """Pages over the batch axes, combined heads over `tensor` where it splits the KV
  heads (never a key from its value)."""
  pages, page_size, combined, head_dim = shape
  return sharding.spec(("batch", None, "kv_heads", None),
                       (pages, page_size, combined // 2, head_dim), mesh)


def combine(k_AxKxDhxL, v_AxKxLxDh):
  """Prompt keys/values in the kernel's order: [A, L, 2K, Dh]."""
  A, K, _, L = k_AxKxDhxL.shape
  kv_AxLxKx2xDh = jnp.stack([jnp.moveaxis(k_AxKxDhxL, 3, 1), jnp.swapaxes(v_AxKxLxDh, 1, 2)],
                            axis=3)
  return kv_AxLxKx2xDh.reshape(A, L, 2 * K, -1)


def attend(q_BxHxDh, k_BxKxDh, v_BxKxDh, kv_PxTxCxDh, page_B, offset_B, table_BxN,
           length_B):
  """Writes each row's new key/value at (page_B, offset_B) (P: none) and attends its
  query to the first `length_B` addresses of its pages `table_BxN` (P: none); returns
  (out_BxHxDh, kv_PxTxCxDh). Rows that write nothing must still have length >= 1."""
  B, H, Dh = q_BxHxDh.shape
  new_BxCxDh = jnp.stack([k_BxKxDh, v_BxKxDh], axis=2).reshape(B, -1, Dh)
  pages = kv_PxTxCxDh.shape[0]
  mesh = jax.sharding.get_abstract_mesh()
  run = functools.partial(_per_shard, pages=pages, scale=1 / math.sqrt(Dh))
  if mesh.empty or mesh.size == 1:
    return run(q_BxHxDh, new_BxCxDh, kv_PxTxCxDh, page_B, offset_B, table_BxN, length_B)
  rows = sharding.spec(("batch",), (B,), mesh)[0]
  pool = pool_spec(mesh, kv_PxTxCxDh.shape)
  heads, row = P(rows, pool[2], None), P(rows)
  return jax.shard_map(
      run, mesh=mesh,
      in_specs=(heads, heads, pool, row, row, P(rows, None), row),
      out_specs=(heads, pool), check_vma=False)(
          q_BxHxDh, new_BxCxDh, kv_PxTxCxDh, page_B, offset_B, table_BxN, length_B)


def block_pages(pool_shape, dtype, pages_per_row: int) -> int:
  """Pages per kernel block for a device's pool of `pool_shape` (P, T, C, Dh)."""
  _, page_size, combined, head_dim = pool_shape
  page_bytes = page_size * combined * head_dim * jnp.dtype(dtype).itemsize
  return max(1, min(pages_per_row, _BLOCK_KEYS // page_size, _BLOCK_BYTES // page_bytes))


def _per_shard(q_BxHxDh, new_BxCxDh, kv_PxTxCxDh, page_B, offset_B, table_BxN, length_B,
               *, pages: int, scale: float):
  """`attend` on one device's rows and pages: global page numbers (pool of `pages`)
  become this shard's, whose part of the pool they are in."""
  B, N = table_BxN.shape
  local = kv_PxTxCxDh.shape[0]
  kv_PxTxCxDh = kv_PxTxCxDh.at[jnp.where(page_B < pages, page_B % local, local),
                               offset_B].set(new_BxCxDh, mode="drop")
  table_BxN = jnp.where(table_BxN < pages, table_BxN % local, 0)
  out_BxHxDh = rpa.ragged_paged_attention(
      q_BxHxDh, kv_PxTxCxDh, length_B, table_BxN, jnp.arange(B + 1, dtype=jnp.int32),
      jnp.array([B], jnp.int32), sm_scale=scale,
      num_kv_pages_per_block=block_pages(kv_PxTxCxDh.shape, kv_PxTxCxDh.dtype, N),
      num_queries_per_block=min(B, _BLOCK_QUERIES))
  return out_BxHxDh, kv_PxTxCxDh
