"""`Policy`: a model config plus its parameters, callable on token ids.

The functional core is `apply(cfg, params, tokens_BxT, ...)` (what jitted train and
sampling steps call); `Policy` bundles a config with params for interactive use:

  policy = models.from_pretrained(path)
  logits_BxTxV = policy(input_ids_BxT)            # float32
"""

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from exgrpo_jax import sharding
from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import lora
from exgrpo_jax.models import transformer

Params = Any


@functools.lru_cache(maxsize=32)
def module(cfg: config_lib.ModelConfig) -> transformer.Transformer:
  return transformer.Transformer(cfg)


def apply(cfg, params, tokens_BxT, valid_BxT=None, cache=None, return_hidden=False, *,
          positions_BxT=None, segment_ids_BxT=None):
  """Runs the model; returns (logits [B,T,V] float32 or hidden [B,T,D], cache).

  `positions_BxT` / `segment_ids_BxT` describe packed rows (see `Transformer.__call__`);
  `params` may be `lora.LoraParams` (the adapters applied unmerged).
  """
  return module(cfg).apply({"params": lora.for_forward(params)}, tokens_BxT, valid_BxT, cache, return_hidden,
                           positions_BxT=positions_BxT, segment_ids_BxT=segment_ids_BxT)


def unembedding(cfg, params) -> jax.Array:
  """The [D, V] output projection (the transposed embedding when tied)."""
  params = lora.base_of(params)
  return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def _init_boxed(cfg, rng):
  # The parameters do not depend on the attention kernel; the einsum traces anywhere
  # (a fused kernel would need the target's devices, e.g. under AOT compilation).
  init_cfg = dataclasses.replace(cfg, attention="xla")
  return module(init_cfg).init(rng, jnp.zeros((1, 1), jnp.int32))["params"]


def init_params(cfg: config_lib.ModelConfig, rng: jax.Array, shardings=None) -> Params:
  """Random parameters (tests, random-init runs and benchmarks); with `shardings`
  (`param_shardings`) each is created on its shards, never whole on one device."""
  init = lambda rng: nn.unbox(_init_boxed(cfg, rng))
  placed = {} if shardings is None else {"out_shardings": shardings}
  return jax.jit(init, **placed)(rng)


def abstract_params(cfg: config_lib.ModelConfig) -> Params:
  """ShapeDtypeStructs of the parameter tree, without allocating it."""
  return nn.unbox(jax.eval_shape(functools.partial(_init_boxed, cfg), jax.random.key(0)))


def logical_axes(cfg: config_lib.ModelConfig) -> Params:
  """The logical axis names of every parameter, e.g. ('layers', 'embed', 'mlp')."""
  boxed = jax.eval_shape(functools.partial(_init_boxed, cfg), jax.random.key(0))
  return nn.get_partition_spec(boxed)


def param_shardings(cfg: config_lib.ModelConfig, mesh, rules=sharding.LEARNER_RULES):
  """A NamedSharding for every parameter of `cfg`'s model on `mesh` (a tree like the
  params), by the logical-axis `rules` of `exgrpo_jax.sharding`."""
  return sharding.tree_shardings(logical_axes(cfg), abstract_params(cfg), mesh, rules)


@dataclasses.dataclass
class Policy:
  """A decoder config and its parameters. `policy(ids)` gives float32 logits."""

  config: config_lib.ModelConfig
  params: Params
  source: str | None = None

  def __call__(self, input_ids_BxT, valid_BxT=None) -> jax.Array:
    logits, _ = _jitted_logits(self.config, self.params, jnp.asarray(input_ids_BxT),
                               None if valid_BxT is None else jnp.asarray(valid_BxT))
    return logits

  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.params))


@functools.partial(jax.jit, static_argnums=0)
def _jitted_logits(cfg, params, tokens_BxT, valid_BxT):
  return apply(cfg, params, tokens_BxT, valid_BxT)
