"""The learner: one jitted, donated optimizer step over a mini-batch of responses.

A mini-batch arrives as M micro-batches of Bm sequences, each `prompt (left-padded to P)
+ response (right-padded to R)`. The step scans over micro-batches accumulating
gradients of the mini-batch objective

  policy_loss(logp, old_logp, adv, mask, is_replay) - entropy_coeff * mean entropy

where every token carries its weight in the whole mini-batch (the aggregation's and the
entropy mean's denominators are the mini-batch's, `packing.token_weights`), so the summed
gradient, and the logged losses, do not depend on the micro-batch size. Log-probs and
entropies come from hidden states, chunked so [B, T, V] float32 logits never exist at
once. The step clips the global gradient norm and applies AdamW unless the norm is
non-finite or above `skip_grad_norm` (then the step is skipped and counted).
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp
import optax

from exgrpo_jax import logprobs
from exgrpo_jax import losses
from exgrpo_jax import models
from exgrpo_jax import sharding
from exgrpo_jax.training import packing

# Micro-batch metrics that add up to the mini-batch's (losses already carry mini-batch
# weights, token counts); "*_max" metrics take the maximum, the rest are token means,
# weighted by the replayed ("off_*") or fresh tokens they average over.
_SUMMED = ("loss", "pg_loss", "on_pg_loss", "off_pg_loss", "entropy", "on_tokens",
           "off_tokens")


@flax.struct.dataclass
class TrainBatch:
  """M micro-batches of Bm sequences; S = P + R tokens each."""

  tokens_MxBxS: jax.Array       # int32
  valid_MxBxS: jax.Array        # bool: real prompt and response tokens
  mask_MxBxR: jax.Array         # bool: response tokens that enter the loss
  old_logp_MxBxR: jax.Array     # float32: pi_old (fresh) or pi_behaviour (replayed)
  adv_MxB: jax.Array            # float32
  is_replay_MxB: jax.Array      # bool
  prompt_len: int = flax.struct.field(pytree_node=False, default=0)


def make_optimizer(optim) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(optim.grad_clip),
      optax.adamw(optim.lr, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                  weight_decay=optim.weight_decay))


def response_stats(cfg, params, tokens_BxS, valid_BxS, prompt_len: int, chunk: int):
  """Per-response-token log-probs and entropies [B, R] at temperature 1."""
  hidden_BxSxD, _ = models.apply(cfg, params, tokens_BxS, valid_BxS, return_hidden=True)
  # Position t's hidden state predicts token t + 1.
  hidden_BxRxD = hidden_BxSxD[:, prompt_len - 1:-1]
  targets_BxR = tokens_BxS[:, prompt_len:]
  return logprobs.token_logprobs_and_entropy(
      hidden_BxRxD, models.unembedding(cfg, params), targets_BxR, chunk_size=chunk)


def score_responses(cfg, params, tokens_BxS, valid_BxS, prompt_len: int, chunk: int):
  """`response_stats` without gradients (old log-probs, trajectory selection).

  On a mesh (sharded params) the rows are split over the batch axes; the results are
  replicated, so every process can read them.
  """
  mesh = sharding.mesh_of(params)
  if mesh is not None:
    tokens_BxS, valid_BxS = sharding.put_batch((tokens_BxS, valid_BxS), mesh)
  return _score_fn(mesh)(cfg, params, tokens_BxS, valid_BxS, prompt_len, chunk)


@functools.lru_cache(maxsize=None)
def _score_fn(mesh):
  out = {} if mesh is None else {"out_shardings": sharding.replicated(mesh)}
  return jax.jit(response_stats, static_argnums=(0, 4, 5), **out)


def _micro_loss(params, micro, *, cfg, algo, use_clip, prompt_len, chunk, num_tokens):
  """The micro-batch's share of the mini-batch objective (`num_tokens`: the mini-batch's
  loss tokens)."""
  tokens_BxS, valid_BxS, mask_BxR, old_logp_BxR, adv_B, is_replay_B, weight_BxR = micro
  logp_BxR, entropy_BxR = response_stats(cfg, params, tokens_BxS, valid_BxS, prompt_len,
                                         chunk)
  is_replay_BxR = jnp.broadcast_to(is_replay_B[:, None], mask_BxR.shape) & mask_BxR
  loss_fn = losses.POLICY_LOSSES.get(algo.loss)
  pg_loss, metrics = loss_fn(
      logp_BxR, old_logp_BxR, adv_B, mask_BxR, is_replay_BxR, clip_eps=algo.clip_eps,
      use_clip=use_clip, shaping_gamma=algo.shaping_gamma, norm_len=algo.norm_len,
      aggregation=algo.aggregation, weight_BxT=weight_BxR)
  entropy = jnp.sum(entropy_BxR * mask_BxR) / num_tokens
  loss = pg_loss - algo.entropy_coeff * entropy
  return loss, dict(metrics, entropy=entropy, pg_loss=pg_loss, loss=loss)


def combine_metrics(metrics_M: dict) -> dict:
  """The mini-batch's metrics from its micro-batches' (each [M]); see `_SUMMED`."""
  combined = {}
  for name, value_M in metrics_M.items():
    if name in _SUMMED:
      combined[name] = value_M.sum()
    elif name.endswith("_max"):
      combined[name] = value_M.max()
    else:
      tokens_M = metrics_M["off_tokens" if name.startswith("off_") else "on_tokens"]
      combined[name] = (value_M * tokens_M).sum() / jnp.maximum(tokens_M.sum(), 1)
  return combined


def accumulate_gradients(params, batch: TrainBatch, *, cfg, algo, use_clip, chunk,
                         param_shardings=None):
  """Gradients of the mini-batch objective and its metrics, one micro-batch at a time."""
  M, Bm, R = batch.mask_MxBxR.shape
  weight_MxBxR = packing.token_weights(batch.mask_MxBxR.reshape(M * Bm, R),
                                       algo.aggregation, algo.norm_len).reshape(M, Bm, R)
  grad_fn = jax.grad(functools.partial(
      _micro_loss, cfg=cfg, algo=algo, use_clip=use_clip, prompt_len=batch.prompt_len,
      chunk=chunk, num_tokens=jnp.maximum(batch.mask_MxBxR.sum(), 1)), has_aux=True)
  # Gradients are accumulated in the parameters' sharding (under FSDP, 1/n of them per
  # device); left to propagation, the zeros could come out replicated.
  constrain = (functools.partial(jax.lax.with_sharding_constraint, shardings=param_shardings)
               if param_shardings is not None else lambda tree: tree)

  def accumulate(grads_acc, micro):
    grads, metrics = grad_fn(params, micro)
    return constrain(jax.tree.map(jnp.add, grads_acc, grads)), metrics

  micro_batches = (batch.tokens_MxBxS, batch.valid_MxBxS, batch.mask_MxBxR,
                   batch.old_logp_MxBxR, batch.adv_MxB, batch.is_replay_MxB, weight_MxBxR)
  zeros = constrain(jax.tree.map(jnp.zeros_like, params))
  grads, metrics_M = jax.lax.scan(accumulate, zeros, micro_batches)
  return grads, combine_metrics(metrics_M)


def train_step(params, opt_state, batch: TrainBatch, *, cfg, algo, optim, use_clip: bool,
               chunk: int):
  """One optimizer step; returns (params, opt_state, metrics). Donates params, opt_state.

  `algo` and `optim` are hashable views of the config sections (see `frozen`). The
  result keeps the shardings `params` and `opt_state` came with (so the next step reuses
  the compiled program); on a mesh, the batch is split over its batch axes.
  """
  mesh = sharding.mesh_of(params)
  if mesh is not None:
    batch = sharding.put_batch(batch, mesh, batch_dim=1)
  flat, treedef = jax.tree.flatten(sharding.shardings_of((params, opt_state)))
  step = _compiled_step(treedef, tuple(flat))
  return step(params, opt_state, batch, cfg=cfg, algo=algo, optim=optim, use_clip=use_clip,
              chunk=chunk)


@functools.lru_cache(maxsize=None)
def _compiled_step(treedef, flat_shardings):
  """The jitted step for parameter / optimizer state with these shardings."""
  param_shardings, opt_shardings = jax.tree.unflatten(treedef, flat_shardings)
  first = flat_shardings[0]
  metrics_sharding = (sharding.replicated(first.mesh)
                      if isinstance(first, sharding.NamedSharding) else first)
  return jax.jit(functools.partial(_train_step, param_shardings=param_shardings),
                 static_argnames=("cfg", "algo", "optim", "use_clip", "chunk"),
                 donate_argnums=(0, 1),
                 out_shardings=(param_shardings, opt_shardings, metrics_sharding))


def _train_step(params, opt_state, batch: TrainBatch, *, cfg, algo, optim, use_clip, chunk,
                param_shardings):
  grads, metrics = accumulate_gradients(params, batch, cfg=cfg, algo=algo, use_clip=use_clip,
                                        chunk=chunk, param_shardings=param_shardings)
  grad_norm = optax.global_norm(grads)
  skip = ~jnp.isfinite(grad_norm) | (grad_norm > optim.skip_grad_norm)
  tx = make_optimizer(optim)
  updates, new_opt_state = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep_old = lambda old, new: jax.tree.map(lambda o, n: jnp.where(skip, o, n), old, new)
  metrics.update(grad_norm=grad_norm, skipped=skip.astype(jnp.float32))
  return keep_old(params, new_params), keep_old(opt_state, new_opt_state), metrics


class Frozen:
  """A hashable, attribute-access snapshot of a ConfigDict section (a jit static arg)."""

  def __init__(self, section):
    self._items = tuple(sorted(section.to_dict().items()))
    for k, v in self._items:
      setattr(self, k, v)

  def __hash__(self):
    return hash(tuple((k, v if not isinstance(v, list) else tuple(v)) for k, v in self._items))

  def __eq__(self, other):
    return isinstance(other, Frozen) and self._items == other._items


def frozen(section) -> Frozen:
  return Frozen(section)
