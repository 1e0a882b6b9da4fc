"""Fused attention kernels on a mesh: each device's rows and heads (`attention._on_shards`).

Runs in a subprocess with 8 CPU devices. On every mesh, `_on_shards` around the einsum
kernel must give the unsharded values and gradients, with rows and heads split as the
sharding rules say (KV heads picked per device where there are fewer than tensor
shards); splash attention (Pallas's interpreter) inside it must match the einsum.
"""

import functools
import json
import os

import pytest

from tests import conftest

# name -> (mesh shape over (data, fsdp, tensor), heads, kv heads, rows)
CASES = {
    "rows_8": ((8, 1, 1), 8, 2, 8),
    "tensor_4_kv_2": ((1, 2, 4), 8, 2, 4),      # kv heads picked per device
    "tensor_2_kv_4": ((2, 2, 2), 8, 4, 4),      # kv heads split like the query heads
    "tensor_8_heads_6": ((1, 1, 8), 6, 2, 2),   # heads do not divide: whole
    "rows_odd": ((1, 4, 2), 4, 2, 3),           # rows do not divide: whole
}
SPLASH_CASES = ("tensor_4_kv_2", "tensor_2_kv_4")


def _child(outdir: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import sharding  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.models import attention  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.models import splash  # pylint: disable=g-import-not-at-top

  assert jax.device_count() == 8
  xla = attention.IMPLEMENTATIONS.get("xla")
  results = {}
  for name, (shape, H, K, B) in CASES.items():
    mesh = jax.make_mesh(shape, sharding.MESH_AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    T, Dh = 128, 128
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, K, Dh, T)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, K, T, Dh)), jnp.float32)
    segments = np.ones((B, T), np.int32)
    segments[0, :10], segments[-1, 70:] = 0, 2  # left padding; a second packed segment
    mask = attention.AttentionMask.packed(jnp.asarray(segments))
    scored = jnp.asarray(segments != 0)[..., None, None]

    def loss(kernel, q, k, v):
      return jnp.sum(jnp.where(scored, kernel(q, k, v, mask), 0.0) ** 2)

    grad = lambda kernel: jax.jit(jax.value_and_grad(functools.partial(loss, kernel),
                                                     (0, 1, 2)))
    reference = grad(xla)(q, k, v)
    on_shards = attention._on_shards  # pylint: disable=protected-access
    kernels = {"xla": functools.partial(on_shards, xla)}
    if name in SPLASH_CASES:
      kernels["splash"] = functools.partial(
          on_shards, functools.partial(splash.attention, interpret=True))
    results[name] = {}
    for kernel_name, kernel in kernels.items():
      with sharding.use_mesh(mesh):
        got = grad(kernel)(q, k, v)
        jaxpr = jax.make_jaxpr(functools.partial(loss, kernel))(q, k, v)
      specs = [str(e.params["in_specs"]) for e in jaxpr.jaxpr.eqns
               if e.primitive.name == "shard_map"]
      results[name][kernel_name] = dict(
          error=max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
                    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference))),
          specs=specs)
  with open(os.path.join(outdir, "results.json"), "w") as f:
    json.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  outdir = tmp_path_factory.mktemp("sharded_attention")
  return conftest.run_on_cpu_devices(
      f"from tests import sharded_attention_test as t; t._child({str(outdir)!r})", 8,
      result=outdir / "results.json")


@pytest.mark.parametrize("case", CASES)
def test_kernel_on_shards_matches_unsharded(results, case):
  assert results[case]["xla"]["error"] <= 1e-6, results[case]


@pytest.mark.parametrize("case", SPLASH_CASES)
def test_splash_on_shards_matches_einsum(results, case):
  assert results[case]["splash"]["error"] <= 1e-5, results[case]


def test_rows_and_heads_split_as_the_rules_say(results):
  specs = {case: results[case]["xla"]["specs"][0] for case in CASES}
  assert "P('data', None, None, None)" in specs["rows_8"]  # rows over data only
  # q heads over tensor, kv heads whole (each device picks its one)
  assert "P('fsdp', None, 'tensor', None)" in specs["tensor_4_kv_2"]
  assert "P('fsdp', None, None, None)" in specs["tensor_4_kv_2"]
  assert "P(('data', 'fsdp'), 'tensor', None, None)" in specs["tensor_2_kv_4"]
  assert "P(None, None, None, None)" in specs["tensor_8_heads_6"]
  assert "P(None, None, 'tensor', None)" in specs["rows_odd"]
