"""The planner's matmul count (`exgrpo_jax.aot.flops`): the same program counts the same
work on any mesh, and attention counts the blocks its kernel computes.

The mesh cases run in a subprocess with 4 CPU devices; programs are traced, not compiled.
"""

import functools
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exgrpo_jax.aot import flops
from exgrpo_jax.models import attention
from exgrpo_jax.models import blockwise
from exgrpo_jax.models import splash
from tests import conftest

# (data, fsdp, tensor) meshes over 1, 2 and 4 devices.
MESHES = {"1": (1, 1, 1), "2_rows": (1, 2, 1), "2_heads": (1, 1, 2), "4": (1, 2, 2),
          "4_rows": (2, 2, 1)}
B, T, H, K, Dh = 4, 1024, 4, 2, 64


def _qkv(T_=T):
  s = jax.ShapeDtypeStruct
  return (s((B, T_, H, Dh), jnp.float32), s((B, K, Dh, T_), jnp.float32),
          s((B, K, T_, Dh), jnp.float32), s((B, T_), jnp.int32))


def _attention_loss(kernel, q, k, v, segments):
  return kernel(q, k, v, attention.AttentionMask.packed(segments)).sum()


def _full(T_=T) -> float:
  """Forward FLOPs of attention over all of T x T (its two matmuls)."""
  return 2 * 2 * B * H * Dh * T_ * T_


def _mesh_child(outdir: str) -> None:
  """Runs in the 4-device process: each count on each mesh."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import sharding  # pylint: disable=g-import-not-at-top

  assert jax.device_count() == 4
  x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
  w = jax.ShapeDtypeStruct((32, 16), jnp.float32)
  on_shards = attention._on_shards  # pylint: disable=protected-access
  kernels = {"xla": attention.IMPLEMENTATIONS.get("xla"),
             "splash": functools.partial(splash.attention, interpret=True)}
  counts = {}
  for name, shape in MESHES.items():
    mesh = jax.make_mesh(shape, sharding.MESH_AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=jax.devices()[:int(np.prod(shape))])
    every = jax.shard_map(lambda a, b: a @ b, mesh=mesh,
                          in_specs=(P("fsdp", None), P(None, "tensor")),
                          out_specs=P("fsdp", "tensor"), check_vma=False)
    counts[name] = dict(matmul=flops.matmul_flops(jax.jit(every).trace(x, w).jaxpr))
    with sharding.use_mesh(mesh):
      rows = jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P("fsdp", None), P()),
                           out_specs=P("fsdp", None), axis_names={"fsdp"}, check_vma=False)
      counts[name]["matmul_rows_only"] = flops.matmul_flops(jax.jit(rows).trace(x, w).jaxpr)
      for kernel_name, kernel in kernels.items():
        loss = functools.partial(_attention_loss, functools.partial(on_shards, kernel))
        counts[name][kernel_name] = flops.matmul_flops(jax.jit(loss).trace(*_qkv()).jaxpr)
        counts[name][kernel_name + "_grad"] = flops.matmul_flops(
            jax.jit(jax.grad(loss, (0, 1, 2))).trace(*_qkv()).jaxpr)
  with open(os.path.join(outdir, "counts.json"), "w", encoding="utf-8") as f:
    json.dump(counts, f)


@pytest.fixture(scope="module")
def mesh_counts(tmp_path_factory):
  outdir = tmp_path_factory.mktemp("flops")
  return conftest.run_on_cpu_devices(
      f"from tests import aot_flops_test as t; t._mesh_child({str(outdir)!r})", 4,
      result=outdir / "counts.json")


def test_a_shard_mapped_matmul_counts_its_unsharded_flops(mesh_counts):
  unsharded = 2 * 64 * 32 * 16
  for name in MESHES:
    # Split over fsdp and tensor; on the data axis, which splits nothing, each device
    # repeats its shard's work.
    assert mesh_counts[name]["matmul"] == unsharded * MESHES[name][0], name
    assert mesh_counts[name]["matmul_rows_only"] == unsharded, name  # one axis manual


@pytest.mark.parametrize("kernel", ["xla", "splash", "xla_grad", "splash_grad"])
def test_attention_on_shards_counts_the_same_on_1_2_and_4_devices(mesh_counts, kernel):
  """Fused kernels run inside `shard_map` on a mesh: each device's rows and heads."""
  one = mesh_counts["1"][kernel]
  assert one > 0
  assert {name: counts[kernel] for name, counts in mesh_counts.items()} == {
      name: one for name in MESHES}


def test_einsum_attention_counts_all_of_t_by_s():
  """XLA's einsum computes the whole score matrix, masked or not."""
  loss = functools.partial(_attention_loss, attention.IMPLEMENTATIONS.get("xla"))
  assert flops.matmul_flops(jax.jit(loss).trace(*_qkv()).jaxpr) == _full()


def test_blockwise_attention_counts_the_blocks_at_or_below_the_diagonal():
  """2048 tokens in blocks of 512: 10 of the 16 blocks; the backward recomputes the
  scores and takes dV, dP, dK and dQ in each (5 matmuls to the forward's 2)."""
  loss = functools.partial(_attention_loss, blockwise.attention)
  assert blockwise.BLOCK == 512
  causal = 10 / 16 * _full(2048)
  assert flops.matmul_flops(jax.jit(loss).trace(*_qkv(2048)).jaxpr) == causal
  grad = jax.jit(jax.grad(loss, (0, 1, 2))).trace(*_qkv(2048))
  assert flops.matmul_flops(grad.jaxpr) == causal * (2 + 5) / 2


def test_splash_attention_counts_the_blocks_its_causal_mask_runs():
  """1024 tokens in blocks of 512: the kernel skips the block above the diagonal."""
  kernel = functools.partial(splash.attention, interpret=True)
  loss = functools.partial(_attention_loss, kernel)
  traced = jax.jit(loss).trace(*_qkv()).jaxpr
  assert flops.matmul_flops(traced) == 3 / 4 * _full()
  # The same program with its constants (the block mask) unknown: every block. (JAX 0.12's
  # jaxpr carries its constants itself, 0.10's beside it in a ClosedJaxpr: both dropped.)
  unknown = types.SimpleNamespace(jaxpr=traced.jaxpr, consts=())
  assert flops.matmul_flops(unknown) == _full()


def test_causal_pairs_are_the_lower_triangle():
  assert flops.causal_pairs(4, 4) == 10
  assert flops.causal_pairs(2, 5) == 4 + 5  # two queries after a cache of three keys
  assert flops.causal_pairs(1, 9) == 9  # a decode step sees every key


def test_a_loop_counts_its_trip_count_where_the_trace_fixes_it():
  """A fori_loop to a bound computed from constants runs that many times; a decode loop
  (a bound the trace does not know) runs the caller's `loop_steps`, and a loop of
  unknown length inside it once."""
  w = jnp.ones((8, 8))

  def fixed(x):
    n = jnp.asarray(3) + jnp.zeros((), jnp.int32)  # traced, but from constants
    return jax.lax.fori_loop(0, n, lambda i, y: y @ w, x)

  def decode(x, n):
    inner = lambda y: jax.lax.fori_loop(0, n, lambda i, z: z @ w, y)
    return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (inner(c[0]), c[1] + 1),
                              (x, 0))[0]

  x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
  step = 2 * 8 * 8 * 8
  assert flops.matmul_flops(jax.jit(fixed).trace(x).jaxpr) == 3 * step
  n = jax.ShapeDtypeStruct((), jnp.int32)
  assert flops.matmul_flops(jax.jit(decode).trace(x, n).jaxpr, loop_steps=5) == 5 * step
