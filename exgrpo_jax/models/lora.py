"""Low-rank adapters (LoRA) over the model's stacked projection weights.

A frozen base weight W (e.g. q_proj [L, D, H, Dh], stacked over the L layers like every
layer weight) gets two trainable factors, A [L, *in, r] and B [L, r, *out], and the
layer computes

  y = x @ W + (alpha / r) * (x @ A) @ B

`LoraParams(base, adapters, scale)` is what a LoRA run carries where a full fine-tuning
run carries its params: `models.apply` runs it unmerged (the model reads each factor
beside its weight, `for_forward`), the learner differentiates the adapters only (the
base is a non-differentiated argument of its step), and the samplers receive `merged`
weights, W + scale * A @ B per layer, so every rollout uses the current adapter.

With `model.lora.base_quant` int8 or nf4 (QLoRA) the base's layer projections, all
seven whether adapted or not, are stored quantized (`quant`, qwix's arrays;
`quantize_base`), and the embeddings, head and norms stay in `param_dtype`. The model
dequantizes each weight inside its layer; `merge` dequantizes before it adds A @ B.

A is random (PEFT's kaiming-uniform: U(-1/sqrt(in), 1/sqrt(in))), B zero, so step 0's
policy is the base model exactly. The factors carry logical axis names (their weight's,
plus `lora_rank`, which no rule splits), so `exgrpo_jax.sharding` places them like their
weights under FSDP and tensor parallelism.
"""

import functools
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from exgrpo_jax import sharding
from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import quant

# Each target projection: its sub-module in a layer, its input and output axes (logical
# names, as `transformer.Attention` / `transformer.MLP` declare the weight).
_TARGETS = {
    "q_proj": ("attn", ("embed",), ("heads", "head_dim")),
    "k_proj": ("attn", ("embed",), ("kv_heads", "head_dim")),
    "v_proj": ("attn", ("embed",), ("kv_heads", "head_dim")),
    "o_proj": ("attn", ("heads", "head_dim"), ("embed",)),
    "gate_proj": ("mlp", ("embed",), ("mlp",)),
    "up_proj": ("mlp", ("embed",), ("mlp",)),
    "down_proj": ("mlp", ("mlp",), ("embed",)),
}
TARGETS = tuple(_TARGETS)
RANK_AXIS = "lora_rank"
BASE_QUANTS = ("none",) + quant.KINDS
# The `model.lora` config section's defaults (configs/common.py).
DEFAULTS = dict(rank=0, alpha=16.0, targets=list(TARGETS), base_quant="none")


def config_problems(lora_config) -> list[str]:
  """One line per bad value of a `model.lora` config section (`config_check`)."""
  key = lambda name: f"config.model.lora.{name}={lora_config[name]!r}"
  rank = lora_config.rank
  if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
    return [f"{key('rank')}: must be a whole number >= 0 (0 = off: full fine-tuning)"]
  if rank == 0:
    return [f"{key(name)}: set only with model.lora.rank > 0 (rank 0 is full fine-tuning)"
            for name, default in DEFAULTS.items()
            if name != "rank" and lora_config[name] != default]
  lines = []
  alpha = lora_config.alpha
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
    lines.append(f"{key('alpha')}: must be a number > 0 (the update's scale is alpha/rank)")
  targets = list(lora_config.targets)
  unknown = [t for t in targets if t not in _TARGETS]
  if unknown or not targets or len(set(targets)) != len(targets):
    lines.append(f"{key('targets')}: name each weight once, from {', '.join(TARGETS)}"
                 + (f" ({', '.join(map(str, unknown))} names no weight)" if unknown else ""))
  if lora_config.base_quant not in BASE_QUANTS:
    lines.append(f"{key('base_quant')}: must be one of {', '.join(BASE_QUANTS)}")
  return lines


@flax.struct.dataclass
class LoraParams:
  """The frozen base params, the adapters {module: {target: {"a", "b"}}} stacked over
  layers, and the update's scale alpha / rank."""

  base: Any
  adapters: Any
  scale: float = flax.struct.field(pytree_node=False)


def scale(lora_config) -> float:
  """alpha / rank of a `model.lora` config section."""
  return lora_config.alpha / lora_config.rank


def _sizes(cfg: config_lib.ModelConfig) -> dict:
  return {"embed": cfg.hidden_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
          "head_dim": cfg.head_dim, "mlp": cfg.intermediate_size}


def logical_axes(targets) -> dict:
  """The adapters' logical axis names (PartitionSpecs), a tree like the adapters."""
  tree = {}
  for name in targets:
    module, in_axes, out_axes = _TARGETS[name]
    tree.setdefault(module, {})[name] = {
        "a": sharding.P("layers", *in_axes, RANK_AXIS),
        "b": sharding.P("layers", RANK_AXIS, *out_axes)}
  return {"layers": tree}


def abstract_adapters(cfg: config_lib.ModelConfig, rank: int, targets) -> dict:
  """ShapeDtypeStructs of the adapters (float32, like the learner's params)."""
  sizes = _sizes(cfg)
  shape = lambda spec: tuple(rank if n == RANK_AXIS else cfg.num_layers if n == "layers"
                             else sizes[n] for n in spec)
  return jax.tree.map(lambda spec: jax.ShapeDtypeStruct(shape(spec), jnp.float32),
                      logical_axes(targets), is_leaf=lambda x: isinstance(x, sharding.P))


def adapter_shardings(cfg, rank: int, targets, mesh, rules=sharding.LEARNER_RULES):
  """A NamedSharding for every adapter on `mesh`, by the logical-axis `rules`."""
  return sharding.tree_shardings(logical_axes(targets), abstract_adapters(cfg, rank, targets),
                                 mesh, rules)


def init_adapters(cfg, rank: int, targets, rng: jax.Array, shardings=None) -> dict:
  """A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PEFT's default), B = 0; created on their
  shards when `shardings` is given."""
  abstract = abstract_adapters(cfg, rank, targets)

  def init(rng):
    leaves = []
    for i, (path, x) in enumerate(jax.tree_util.tree_leaves_with_path(abstract)):
      if path[-1].key == "b":
        leaves.append(jnp.zeros(x.shape, x.dtype))
      else:
        bound = 1.0 / math.sqrt(math.prod(x.shape[1:-1]))
        leaves.append(jax.random.uniform(jax.random.fold_in(rng, i), x.shape, x.dtype,
                                         -bound, bound))
    return jax.tree.unflatten(jax.tree.structure(abstract), leaves)

  placed = {} if shardings is None else {"out_shardings": shardings}
  return jax.jit(init, **placed)(rng)


def _with_targets(params: LoraParams, entries):
  """The base tree with `entries(name, weight, {"a", "b"})`'s {key: array} set in each
  target's module."""
  layers = {module: dict(weights) for module, weights in params.base["layers"].items()}
  for module, targets in params.adapters["layers"].items():
    for name, ab in targets.items():
      layers[module].update(entries(name, layers[module][name], ab))
  return dict(params.base, layers=layers)


def quantize_weight(path, w, base_quant: str, shardings=None):
  """The base's weight `w` at `path` (its keys, e.g. ("layers", "attn", "q_proj")) as a
  base with `base_quant` stores it: a layer projection quantized (placed by the
  quantized base's `shardings`, `base_shardings`), anything else as it is."""
  if base_quant == "none" or tuple(path[:1]) != ("layers",) or path[-1] not in _TARGETS:
    return w
  placed = {} if shardings is None else {
      "out_shardings": shardings["layers"][_TARGETS[path[-1]][0]][path[-1]]}
  n_in = len(_TARGETS[path[-1]][1])
  return jax.jit(functools.partial(quant.quantize, kind=base_quant, n_in=n_in),
                 **placed)(w)


def quantize_base(base, base_quant: str, shardings=None):
  """`base` with every layer projection quantized (`quantize_weight`), one weight at a
  time; as it is for "none"."""
  layers = {module: {name: quantize_weight(("layers", module, name), w, base_quant,
                                           shardings)
                     for name, w in weights.items()}
            for module, weights in base["layers"].items()}
  return dict(base, layers=layers)


def abstract_base(abstract_params, base_quant: str):
  """ShapeDtypeStructs of the base a run with `base_quant` holds (`quantize_base`)."""
  return jax.eval_shape(functools.partial(quantize_base, base_quant=base_quant),
                        abstract_params)


def base_logical_axes(param_axes, abstract):
  """The logical axis names of the `abstract` base (`abstract_base`), given the
  params' (`models.logical_axes`): a quantized weight's by `quant.logical_axes`."""
  return jax.tree.map(
      lambda x, names: quant.logical_axes(names, x) if quant.is_quantized(x) else names,
      abstract, param_axes, is_leaf=quant.is_quantized)


def for_forward(params):
  """The tree the model applies: plain params as they are; for `LoraParams`, the base
  with each target's factors beside its weight (`<name>_lora_a`, `<name>_lora_b`, B
  already scaled), which `transformer` adds unmerged."""
  if not isinstance(params, LoraParams):
    return params
  return _with_targets(params, lambda name, w, ab: {
      name + "_lora_a": ab["a"], name + "_lora_b": ab["b"] * params.scale})


def _delta(a_Lx_in_xr: jax.Array, b_Lxrx_out: jax.Array, scale_: float) -> jax.Array:
  """scale * A @ B per layer, in the weight's shape [L, *in, *out] (float32)."""
  L, r = a_Lx_in_xr.shape[0], a_Lx_in_xr.shape[-1]
  a_LxIxr = a_Lx_in_xr.reshape(L, -1, r).astype(jnp.float32)
  b_LxrxO = b_Lxrx_out.reshape(L, r, -1).astype(jnp.float32)
  product = scale_ * jnp.einsum("lir,lro->lio", a_LxIxr, b_LxrxO)
  return product.reshape(a_Lx_in_xr.shape[:-1] + b_Lxrx_out.shape[2:])


def merge(params):
  """`merged`'s computation, to trace inside a caller's program (the JAX engine merges
  while it reshards and casts its rollout copy, so no merged copy outlives it). A
  quantized base is dequantized first: the merged weights are in `param_dtype`."""
  if not isinstance(params, LoraParams):
    return params
  params = params.replace(base=quant.dequantize_tree(params.base))
  return _with_targets(params, lambda name, w, ab: {name: (
      w.astype(jnp.float32) + _delta(ab["a"], ab["b"], params.scale)).astype(w.dtype)})


@functools.lru_cache(maxsize=None)
def _merge_program(treedef, flat_shardings):
  placed = ({} if treedef is None
            else {"out_shardings": jax.tree.unflatten(treedef, flat_shardings)})
  return jax.jit(merge, **placed)


def merged(params):
  """Plain params: `LoraParams` with W + scale * A @ B in every target (one jitted
  program, in the base's shardings and dtypes; a quantized weight's codes' sharding);
  plain params as they are. What the samplers and the HF export receive."""
  if not isinstance(params, LoraParams):
    return params
  if sharding.mesh_of(params.base) is None:
    return _merge_program(None, None)(params)
  flat, treedef = jax.tree.flatten(quant.plain_shardings(sharding.shardings_of(params.base)))
  return _merge_program(treedef, tuple(flat))(params)


def base_of(params):
  """The frozen base of `LoraParams`; plain params as they are."""
  return params.base if isinstance(params, LoraParams) else params
