"""Device meshes, logical-axis rules, and sharded parameters, optimizer state and batches.

`config.mesh` names the mesh: `shape=(-1, 1), axes=("fsdp", "tensor")` (one -1 takes the
remaining devices; axes are any of `data`, `fsdp`, `tensor`). Every parameter carries
logical axis names (`models.logical_axes`); a rule table maps each name to the mesh axes
it may be split over, in order of preference:

  LEARNER_RULES  batch -> (data, fsdp); embed -> fsdp (ZeRO-3: weights, gradients and
                 AdamW moments split over fsdp, gathered layer by layer); vocab, mlp,
                 heads, kv_heads -> tensor (Megatron-style tensor parallelism).
  SAMPLER_RULES  the same without FSDP on weights: a decode step touches every weight
                 for one token per row, so gathering them each step would dominate; the
                 rollout copy is resharded from the learner's in device memory once per
                 `generate` call (`jax.device_put` between shardings of one mesh).

A mesh axis that does not divide a dimension (or is already used by another dimension of
the same array) is skipped for it, so any model runs on any mesh (e.g. SmolLM2's 9 heads
stay whole under tensor=2 while its MLP is split).

Parameters and optimizer state are created directly sharded: shapes come from
`jax.eval_shape`, then `jax.jit(init, out_shardings=...)` materialises each shard on its
device (`models.param_shardings` applies these rules to the model's tree;
`models.loading.load_params(..., shardings=)` places each HF tensor as read).
Jitted steps need no mesh argument: they read the mesh from their parameters'
shardings (`mesh_of`), place host batches with `put_batch` and keep their outputs on the
input shardings, so a step compiles once. They are traced under `use_mesh(mesh)`, so
code inside them that must partition by hand (`shard_map` around a fused attention
kernel, which XLA cannot split) finds the mesh and its platform
(`jax.sharding.get_abstract_mesh()`), also when compiling ahead of time for devices
that are not attached (`exgrpo_jax.aot`).
"""

import contextlib
import math

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding

MESH_AXES = ("data", "fsdp", "tensor")

LEARNER_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", ("fsdp",)),
    ("vocab", ("tensor",)),
    ("mlp", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
)
SAMPLER_RULES = tuple((name, () if name == "embed" else axes) for name, axes in LEARNER_RULES)


def make_mesh(mesh_config, devices=None) -> jax.sharding.Mesh:
  """The mesh `mesh_config.shape` over `mesh_config.axes` (one size may be -1)."""
  shape, axes = tuple(mesh_config.shape), tuple(mesh_config.axes)
  devices = list(jax.devices() if devices is None else devices)
  if len(shape) != len(axes):
    raise ValueError(f"config.mesh: shape {shape} and axes {axes} differ in length")
  unknown = sorted(set(axes) - set(MESH_AXES))
  if unknown or len(set(axes)) != len(axes):
    raise ValueError(f"config.mesh.axes={axes}: use each of {MESH_AXES} at most once"
                     + (f" (unknown: {unknown})" if unknown else ""))
  if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"config.mesh.shape={shape}: positive sizes and at most one -1")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(f"config.mesh.shape={shape}: {len(devices)} devices are not a "
                       f"multiple of {known}")
    shape = tuple(len(devices) // known if s == -1 else s for s in shape)
  if math.prod(shape) != len(devices):
    raise ValueError(f"config.mesh.shape={shape} needs {math.prod(shape)} devices, "
                     f"{len(devices)} are present")
  return jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
                       devices=devices)


def spec(names, shape, mesh: jax.sharding.Mesh, rules=LEARNER_RULES) -> P:
  """The PartitionSpec of an array with logical axis `names` and `shape` on `mesh`."""
  table = dict(rules)
  used, out = set(), []
  for name, size in zip(names, shape):
    axes = []
    for axis in table.get(name, ()):
      n = mesh.shape.get(axis, 1)
      if n > 1 and axis not in used and size % (n * math.prod(mesh.shape[a] for a in axes)) == 0:
        axes.append(axis)
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return P(*out)


def tree_shardings(names_tree, abstract_tree, mesh, rules=LEARNER_RULES):
  """A NamedSharding for every array of `abstract_tree`, whose logical axis names
  `names_tree` (a tree of PartitionSpecs of names, as Flax gives them) holds."""
  return jax.tree.map(
      lambda names, x: NamedSharding(mesh, spec(tuple(names), x.shape, mesh, rules)),
      names_tree, abstract_tree, is_leaf=lambda x: isinstance(x, P))


def optimizer_shardings(tx: optax.GradientTransformation, abstract_params, shardings):
  """Shardings of `tx`'s state: moments follow their parameter, counters are replicated."""
  abstract_state = jax.eval_shape(tx.init, abstract_params)
  return optax.tree_map_params(tx, lambda _, s: s, abstract_state, shardings,
                               transform_non_params=lambda _: replicated(mesh_of(shardings)))


def init_optimizer(tx, params, shardings):
  """`tx.init(params)` created directly with `shardings`."""
  return jax.jit(tx.init, out_shardings=shardings)(params)


def use_mesh(mesh):
  """The context jitted programs on `mesh` are traced (and compiled) in; none for None."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def abstract(tree, shardings):
  """ShapeDtypeStructs of `tree` (arrays or ShapeDtypeStructs) carrying `shardings`."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def mesh_of(tree) -> jax.sharding.Mesh | None:
  """The mesh of the first NamedSharding found in `tree` (arrays or shardings)."""
  for leaf in jax.tree.leaves(tree):
    s = leaf if isinstance(leaf, jax.sharding.Sharding) else getattr(leaf, "sharding", None)
    if isinstance(s, NamedSharding):
      return s.mesh
  return None


def shardings_of(tree):
  return jax.tree.map(lambda x: x.sharding, tree)


def batch_shards(mesh) -> int:
  """How many ways a batch is split: the product of the mesh's batch axes' sizes (1
  without a mesh)."""
  if mesh is None:
    return 1
  return math.prod(mesh.shape.get(axis, 1) for axis in dict(LEARNER_RULES)["batch"])


def batch_sharding(mesh, shape, batch_dim: int = 0) -> NamedSharding:
  """Dimension `batch_dim` split over the batch axes (data, fsdp) where they divide it."""
  names = [None] * len(shape)
  names[batch_dim] = "batch"
  return NamedSharding(mesh, spec(names, shape, mesh))


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def put_batch(tree, mesh, batch_dim: int = 0):
  """Places host arrays (identical on every process) split along `batch_dim`.

  Each process copies only the slices its own devices hold, so no batch travels between
  processes. PRNG key arrays are placed as their key data.
  """
  def put(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(put(jax.random.key_data(x)), impl=jax.random.key_impl(x))
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, _placement(mesh, x.shape, batch_dim),
                                        lambda index: x[index])
  return jax.tree.map(put, tree)


def placed(tree, mesh, batch_dim: int = 0):
  """ShapeDtypeStructs of `tree` (arrays or ShapeDtypeStructs) as `put_batch` would
  place them: what a program compiled ahead of time receives."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=_placement(mesh, x.shape, batch_dim)), tree)


def _placement(mesh, shape, batch_dim: int) -> NamedSharding:
  return batch_sharding(mesh, shape, batch_dim) if len(shape) else replicated(mesh)


def to_host(tree):
  """NumPy copies of (possibly multi-process) arrays; every process gets all of each."""
  def get(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
  return jax.tree.map(get, tree)


def bytes_per_device(tree) -> int:
  """The largest number of bytes `tree`'s arrays hold on any one (local) device."""
  totals = {}
  for x in jax.tree.leaves(tree):
    for shard in x.addressable_shards:
      totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
  return max(totals.values(), default=0)
