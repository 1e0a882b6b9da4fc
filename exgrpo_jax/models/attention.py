"""Attention of RoPE'd queries over keys/values: one entry point, swappable kernels.

`attend(name, q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask)` runs the implementation that
`ModelConfig.attention` names (see `IMPLEMENTATIONS`):

  xla        the einsum reference: materialises [B, H, T, S] scores (and, for the
             backward, probabilities); every backend.
  blockwise  pure JAX online softmax over [512 x 512] query/key blocks with a custom VJP,
             so neither the forward nor the backward holds more than one block of scores;
             blocks above the causal diagonal are skipped. Every backend.
  cudnn      `jax.nn.dot_product_attention(implementation="cudnn")`: NVIDIA GPUs,
             bfloat16/float16.
  splash     Pallas splash attention: TPU.
  auto       cudnn on an NVIDIA GPU (16-bit compute), splash on TPU, otherwise blockwise
             from `AUTO_BLOCKWISE_FROM` keys on (xla below, where it is faster on CPU).

The platform is the target's: the devices of the mesh the program is traced on
(`sharding.use_mesh`; compile-only TPU or GPU devices when compiling ahead of time on
a CPU host), else the default backend's. XLA cannot partition the fused kernels
(Mosaic refuses, cuDNN's partitioner wants q, k and v alike), so on a mesh they run
inside `shard_map`: rows split over the batch axes, heads over `tensor`, each device
calling the kernel on its own rows and heads (`_on_shards`).

Keys/values come in the KV cache's layout (`transformer.KVCache`), so the prefill path
needs no transpose of the cache. `AttentionMask` says who attends to whom in O(T + S)
memory: causal by slot, within a segment (packed rows), never to padding.
"""

import math

import flax.struct
import jax
import jax.numpy as jnp

from exgrpo_jax import registry
from exgrpo_jax import sharding
from exgrpo_jax.models import blockwise
from exgrpo_jax.models import config as config_lib

IMPLEMENTATIONS = registry.Registry("attention implementation")
# Kernels XLA cannot partition: on a mesh they run per shard (`_on_shards`).
FUSED = ("cudnn", "splash")
# auto on CPU: below this many key slots the einsum is as fast or faster (1.05x at 512,
# blockwise 0.53x at 1024: scripts/bench/bench_attention.py,
# docs/results/bench_attention_cpu.json).
AUTO_BLOCKWISE_FROM = 1024

_NEG_INF = float(jnp.finfo(jnp.float32).min)
P = jax.sharding.PartitionSpec


@flax.struct.dataclass
class AttentionMask:
  """Query t (at cache slot q_offset + t) attends to key slot s iff s <= q_offset + t,
  kv_segment_BxS[s] != 0, and (when q_segment_BxT is given) q_segment[t] == kv_segment[s].

  kv_segment_BxS: int32, 0 on padding / empty slots, else the key's segment (1 when
    rows are not packed).
  q_segment_BxT: int32 segment of each query for packed rows; None when every query may
    see every valid key before it (padded rows, the KV cache).
  q_offset: int32 scalar, the slot of query 0 (the cache index; 0 without a cache).
  """

  kv_segment_BxS: jax.Array
  q_segment_BxT: jax.Array | None
  q_offset: jax.Array

  @classmethod
  def padded(cls, valid_BxS, q_offset=0) -> "AttentionMask":
    return cls(valid_BxS.astype(jnp.int32), None, jnp.asarray(q_offset, jnp.int32))

  @classmethod
  def packed(cls, segment_ids_BxT) -> "AttentionMask":
    segment_ids_BxT = segment_ids_BxT.astype(jnp.int32)
    return cls(segment_ids_BxT, segment_ids_BxT, jnp.zeros((), jnp.int32))

  def block(self, t0, bq, s0, bk) -> jax.Array:
    """The [B, bq, bk] boolean mask of queries [t0, t0+bq) over keys [s0, s0+bk)."""
    kv_BxS = jax.lax.dynamic_slice_in_dim(self.kv_segment_BxS, s0, bk, axis=1)
    q_slot_T = self.q_offset + t0 + jnp.arange(bq)
    allowed = ((s0 + jnp.arange(bk))[None, :] <= q_slot_T[:, None])[None] \
        & (kv_BxS != 0)[:, None, :]
    if self.q_segment_BxT is not None:
      q_BxT = jax.lax.dynamic_slice_in_dim(self.q_segment_BxT, t0, bq, axis=1)
      allowed &= q_BxT[:, :, None] == kv_BxS[:, None, :]
    return allowed

  def dense(self, T: int) -> jax.Array:
    return self.block(0, T, 0, self.kv_segment_BxS.shape[1])


def einsum_attention(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask_BxTxS):
  """Grouped-query attention with an explicit [B, T, S] mask (also the decode kernel)."""
  # Query rows m = (group member g, position t) per KV head, so both attention matmuls
  # are plain [M, Dh] x [Dh, S] and [M, S] x [S, Dh] matmuls batched over (b, k), which
  # XLA:CPU's library dot runs directly; other arrangements made XLA transpose the
  # cache (or, on every decode step, the o_proj weight) or use a slow generic dot.
  dt = q_BxTxHxDh.dtype
  B, T, H, Dh = q_BxTxHxDh.shape
  K, S = k_BxKxDhxS.shape[1], k_BxKxDhxS.shape[3]
  G = H // K
  q_BxKxMxDh = q_BxTxHxDh.reshape(B, T, K, G, Dh).transpose(0, 2, 3, 1, 4).reshape(
      B, K, G * T, Dh)
  scores = jnp.einsum("bkmh,bkhs->bkms", q_BxKxMxDh, k_BxKxDhxS,
                      preferred_element_type=jnp.float32) / math.sqrt(Dh)
  scores = jnp.where(mask_BxTxS[:, None, None], scores.reshape(B, K, G, T, S), _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt).reshape(B, K, G * T, S)
  out_BxKxMxDh = jnp.einsum("bkms,bksh->bkmh", probs, v_BxKxSxDh)
  return out_BxKxMxDh.reshape(B, K, G, T, Dh).transpose(0, 3, 1, 2, 4).reshape(
      B, T, H, Dh)


@IMPLEMENTATIONS.register("xla")
def _xla(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask: AttentionMask):
  return einsum_attention(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh,
                          mask.dense(q_BxTxHxDh.shape[1]))


@IMPLEMENTATIONS.register("blockwise")
def _blockwise(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask: AttentionMask):
  return blockwise.attention(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask)


@IMPLEMENTATIONS.register("cudnn")
def _cudnn(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask: AttentionMask):
  # cuDNN builds the padding/segment mask into a [B, 1, T, S] bias (2 bytes per entry,
  # not per head); the causal part it skips block-wise itself when there is no cache.
  if jnp.dtype(q_BxTxHxDh.dtype).itemsize != 2:
    raise ValueError(f"model.attention='cudnn' needs model.dtype bfloat16 or float16, not "
                     f"{jnp.dtype(q_BxTxHxDh.dtype).name}; use auto, xla or blockwise")
  T, S = q_BxTxHxDh.shape[1], k_BxKxDhxS.shape[3]
  mask_BxTxS = mask.dense(T)
  # cuDNN's backward with a mask refuses odd lengths ("Unsupported sequence length Q 45,
  # KV 45" on an H200): pad to even with a query no one reads, which sees only key 0 (a
  # row with no key would be NaN), and a key no real query sees.
  pad_t, pad_s = T % 2, S % 2
  if pad_t or pad_s:
    q_BxTxHxDh = jnp.pad(q_BxTxHxDh, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
    k_BxKxDhxS = jnp.pad(k_BxKxDhxS, ((0, 0), (0, 0), (0, 0), (0, pad_s)))
    v_BxKxSxDh = jnp.pad(v_BxKxSxDh, ((0, 0), (0, 0), (0, pad_s), (0, 0)))
    mask_BxTxS = jnp.pad(mask_BxTxS, ((0, 0), (0, pad_t), (0, pad_s)))
    if pad_t:
      mask_BxTxS = mask_BxTxS.at[:, T, 0].set(True)
  out_BxTxHxDh = jax.nn.dot_product_attention(
      q_BxTxHxDh, k_BxKxDhxS.transpose(0, 3, 1, 2), v_BxKxSxDh.transpose(0, 2, 1, 3),
      mask=mask_BxTxS[:, None], implementation="cudnn")
  return out_BxTxHxDh[:, :T]


@IMPLEMENTATIONS.register("splash")
def _splash(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask: AttentionMask):
  from exgrpo_jax.models import splash  # pylint: disable=g-import-not-at-top
  return splash.attention(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask)


def target() -> tuple[str, str]:
  """(platform, device kind) of the devices this code runs on: the mesh being traced
  on (`sharding.use_mesh`), else the default backend's first device."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    device = mesh.abstract_device
    return device.platform, str(device.device_kind)
  device = jax.devices()[0]
  return device.platform, device.device_kind


def supported(platform: str | None = None, device_kind: str | None = None) -> tuple[str, ...]:
  """The `model.attention` values `platform` (default: the target's) can run."""
  if platform is None:
    platform, device_kind = target()
  names = ["auto", "xla", "blockwise"]
  if platform in ("gpu", "cuda") and "nvidia" in (device_kind or "").lower():
    names.append("cudnn")
  if platform == "tpu":
    names.append("splash")
  return tuple(names)


def check_supported(name: str, platform: str | None = None,
                    device_kind: str | None = None) -> None:
  """Raises ValueError (one line naming the alternatives) if `name` cannot run there."""
  if platform is None:
    platform, device_kind = target()
  if name not in config_lib.ATTENTIONS:
    raise ValueError(f"model.attention={name!r} is unknown; "
                     f"choose one of {', '.join(config_lib.ATTENTIONS)}")
  names = supported(platform, device_kind)
  if name not in names:
    raise ValueError(f"model.attention={name!r} cannot run on {device_kind or platform} "
                     f"({platform}); choose one of {', '.join(names)}")


def resolve(name: str, dtype, num_keys: int, with_cache: bool = False) -> str:
  """The concrete implementation `name` stands for on the target and this shape."""
  platform, device_kind = target()
  check_supported(name, platform, device_kind)
  if name != "auto":
    return name
  names = supported(platform, device_kind)
  if "cudnn" in names and jnp.dtype(dtype).itemsize == 2:
    return "cudnn"
  if "splash" in names and not with_cache:
    return "splash"
  return "blockwise" if num_keys >= AUTO_BLOCKWISE_FROM else "xla"


def _on_shards(kernel, q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask: AttentionMask):
  """`kernel` on each device's rows and heads of the traced mesh (see the docstring).

  Rows split over the batch axes and heads over `tensor` where they divide. When the KV
  heads cannot be split like the query heads (fewer KV heads than tensor shards), each
  device keeps every KV head and takes the one its query heads share; where neither
  works the heads stay whole.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return kernel(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask)
  B, _, H, _ = q_BxTxHxDh.shape
  K = k_BxKxDhxS.shape[1]
  rows = sharding.spec(("batch",), (B,), mesh)[0]
  heads = sharding.spec(("heads",), (H,), mesh)[0]
  kv_heads = sharding.spec(("kv_heads",), (K,), mesh)[0]
  shards = 1 if heads is None else mesh.shape[heads]
  local_heads, group = H // shards, H // K
  pick_kv_head = heads is not None and kv_heads != heads
  if pick_kv_head and group % local_heads:
    heads, pick_kv_head = None, False
  kv_heads = heads if not pick_kv_head else None

  def per_shard(q, k, v, mask):
    if pick_kv_head:  # this shard's query heads all read KV head i * local_heads // group
      first = jax.lax.axis_index(heads) * local_heads // group
      k = jax.lax.dynamic_slice_in_dim(k, first, 1, axis=1)
      v = jax.lax.dynamic_slice_in_dim(v, first, 1, axis=1)
    return kernel(q, k, v, mask)

  row = P(rows, None)
  mask_spec = AttentionMask(row, None if mask.q_segment_BxT is None else row, P())
  return jax.shard_map(
      per_shard, mesh=mesh,
      in_specs=(P(rows, None, heads, None), P(rows, kv_heads, None, None),
                P(rows, kv_heads, None, None), mask_spec),
      out_specs=P(rows, None, heads, None), check_vma=False)(
          q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask)


def attend(name, q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask: AttentionMask):
  """Attention output [B, T, H, Dh] (dtype of q) with implementation `name`."""
  impl = resolve(name, q_BxTxHxDh.dtype, k_BxKxDhxS.shape[3],
                 with_cache=q_BxTxHxDh.shape[1] != k_BxKxDhxS.shape[3])
  kernel = IMPLEMENTATIONS.get(impl)
  if impl in FUSED:
    return _on_shards(kernel, q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask)
  return kernel(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask)
