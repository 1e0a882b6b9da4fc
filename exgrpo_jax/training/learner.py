"""The learner: one jitted, donated optimizer step over a mini-batch of responses.

A mini-batch arrives as M micro-batches of Bm rows of T tokens, each row packing whole
sequences `prompt + response` (`packing`: segment ids, and R scored slots per row that
say which hidden state predicts which response token). The step scans over
micro-batches, skipping empty ones, accumulating gradients of the mini-batch objective

  policy_loss(logp, old_logp, adv, mask, is_replay) - entropy_coeff * mean entropy

where every token carries its weight in the whole mini-batch (the aggregation's and the
entropy mean's denominators are the mini-batch's, `packing.token_weights`), so the summed
gradient, and the logged losses, do not depend on the micro-batch size or the packing.
Log-probs and entropies come from the scored slots' hidden states, chunked so
[B, R, V] float32 logits never exist at once. The step clips the global gradient norm
and applies AdamW unless the norm is non-finite or above `skip_grad_norm` (then the
step is skipped and counted).

With LoRA (`params` a `lora.LoraParams`) the step differentiates and updates the
adapters only: the optimizer state is the adapters', and the frozen base enters the
step as an argument that is neither differentiated nor donated.
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from exgrpo_jax import logprobs
from exgrpo_jax import losses
from exgrpo_jax import models
from exgrpo_jax import sharding
from exgrpo_jax.models import lora

# One rule per metric, over a mini-batch's micro-batches and over a training step's
# mini-batches alike (`combine_metrics`): counts and shares of one objective add up,
# "*_max" metrics take the maximum, grad_norm is the mean over optimizer steps, and the
# rest are token means, weighted by the replayed ("off_*") or fresh tokens they average
# over.
_SUMMED = ("loss", "pg_loss", "on_pg_loss", "off_pg_loss", "entropy", "on_tokens",
           "off_tokens", "skipped")
_PER_OPTIMIZER_STEP = ("grad_norm",)


@flax.struct.dataclass
class TrainBatch:
  """M micro-batches of Bm packed rows of T tokens, with R scored slots per row."""

  tokens_MxBxT: jax.Array       # int32
  segment_ids_MxBxT: jax.Array  # int32: 0 on padding, 1, 2, ... per sequence in a row
  index_MxBxR: jax.Array        # int32: the column whose hidden state scores the slot
  mask_MxBxR: jax.Array         # bool: slots holding a response token (the loss's)
  old_logp_MxBxR: jax.Array     # float32: pi_old (fresh) or pi_behaviour (replayed)
  adv_MxBxR: jax.Array          # float32: the slot's sequence's advantage
  is_replay_MxBxR: jax.Array    # bool
  weight_MxBxR: jax.Array       # float32: the slot's weight in the policy loss
  # float32: log pi_old - log pi_rollout at the rollout temperature (fresh slots; 0
  # elsewhere), for the rollout-mismatch metrics and `algo.tis_cap`; None when pi_old
  # is not recomputed.
  rollout_log_ratio_MxBxR: jax.Array | None = None


def make_optimizer(optim) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(optim.grad_clip),
      optax.adamw(optim.lr, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                  weight_decay=optim.weight_decay))


def abstract_state(cfg, tx: optax.GradientTransformation, mesh):
  """The learner's parameters and `tx`'s state as ShapeDtypeStructs, each sharded on
  `mesh` as the trainer creates them (`models.param_shardings`)."""
  abstract = models.abstract_params(cfg)
  param_shardings = models.param_shardings(cfg, mesh)
  opt_shardings = sharding.optimizer_shardings(tx, abstract, param_shardings)
  return (sharding.abstract(abstract, param_shardings),
          sharding.abstract(jax.eval_shape(tx.init, abstract), opt_shardings))


def _slots(cfg, params, tokens_BxT, segment_ids_BxT, index_BxR):
  """The hidden states [B, R, D] the slots are scored from, and their targets [B, R]."""
  hidden_BxTxD, _ = models.apply(cfg, params, tokens_BxT, return_hidden=True,
                                 segment_ids_BxT=segment_ids_BxT)
  hidden_BxRxD = jnp.take_along_axis(hidden_BxTxD, index_BxR[..., None], axis=1)
  return hidden_BxRxD, jnp.take_along_axis(tokens_BxT, index_BxR + 1, axis=1)


def response_stats(cfg, params, tokens_BxT, segment_ids_BxT, index_BxR, chunk: int):
  """Log-probs and entropies [B, R] (temperature 1) of the tokens the slots score."""
  hidden_BxRxD, targets_BxR = _slots(cfg, params, tokens_BxT, segment_ids_BxT, index_BxR)
  return logprobs.token_logprobs_and_entropy(
      hidden_BxRxD, models.unembedding(cfg, params), targets_BxR, chunk_size=chunk)


def score_stats(cfg, params, tokens_BxT, segment_ids_BxT, index_BxR, chunk: int,
                rollout_temperature: float | None = None):
  """`response_stats` without gradients, and the log-probs [B, R] at
  `rollout_temperature` from the same logits (None when not given)."""
  if rollout_temperature is None:
    logp_BxR, entropy_BxR = response_stats(cfg, params, tokens_BxT, segment_ids_BxT,
                                           index_BxR, chunk)
    return logp_BxR, entropy_BxR, None
  hidden_BxRxD, targets_BxR = _slots(cfg, params, tokens_BxT, segment_ids_BxT, index_BxR)
  return logprobs.token_logprobs_at_two_temperatures(
      hidden_BxRxD, models.unembedding(cfg, params), targets_BxR, rollout_temperature,
      chunk_size=chunk)


def score_responses(cfg, params, tokens_BxT, segment_ids_BxT, index_BxR, chunk: int,
                    rollout_temperature: float | None = None):
  """`score_stats`: (log-probs, entropies, log-probs at `rollout_temperature` or None)
  for old log-probs and trajectory selection.

  On a mesh (sharded params) the rows are split over the batch axes; the results are
  replicated, so every process can read them.
  """
  rows = (tokens_BxT, segment_ids_BxT, index_BxR)
  mesh = sharding.mesh_of(params)
  if mesh is not None:
    rows = sharding.put_batch(rows, mesh)
  with sharding.use_mesh(mesh):
    return score_program(mesh)(cfg, params, *rows, chunk, rollout_temperature)


@functools.lru_cache(maxsize=None)
def score_program(mesh):
  """The jitted `score_stats` that `score_responses` runs on `mesh` (None: unsharded)."""
  out = {} if mesh is None else {"out_shardings": sharding.replicated(mesh)}
  return jax.jit(score_stats, static_argnums=(0, 5, 6), **out)


def _micro_loss(params, micro: TrainBatch, frozen=None, *, cfg, algo, use_clip, chunk,
                num_tokens):
  """The micro-batch's share of the mini-batch objective. `micro` is a TrainBatch without
  its M axis; `num_tokens` counts the mini-batch's loss tokens. With `frozen` (a
  `lora.LoraParams` without adapters) `params` are its adapters."""
  if frozen is not None:
    params = frozen.replace(adapters=params)
  logp_BxR, entropy_BxR = response_stats(cfg, params, micro.tokens_MxBxT,
                                         micro.segment_ids_MxBxT, micro.index_MxBxR, chunk)
  # One token per row: a packed row's slots belong to different sequences, so the
  # advantage comes per token.
  column = lambda x_BxR: x_BxR.reshape(-1, 1)
  loss_fn = losses.POLICY_LOSSES.get(algo.loss)
  rollout_log_ratio = micro.rollout_log_ratio_MxBxR
  pg_loss, metrics = loss_fn(
      column(logp_BxR), column(micro.old_logp_MxBxR), micro.adv_MxBxR.reshape(-1),
      column(micro.mask_MxBxR), column(micro.is_replay_MxBxR & micro.mask_MxBxR),
      clip_eps=algo.clip_eps, use_clip=use_clip, shaping_gamma=algo.shaping_gamma,
      norm_len=algo.norm_len, aggregation=algo.aggregation,
      weight_BxT=column(micro.weight_MxBxR),
      rollout_log_ratio_BxT=None if rollout_log_ratio is None else column(rollout_log_ratio),
      tis_cap=algo.tis_cap)
  entropy = jnp.sum(entropy_BxR * micro.mask_MxBxR) / num_tokens
  loss = pg_loss - algo.entropy_coeff * entropy
  return loss, dict(metrics, entropy=entropy, pg_loss=pg_loss, loss=loss)


def combine_metrics(metrics_M: dict) -> dict:
  """The metrics of M parts (each [M]: micro-batches, or a step's mini-batches whose
  losses are scaled to shares, `combine_step_metrics`) as one; see `_SUMMED`."""
  combined = {}
  for name, value_M in metrics_M.items():
    if name in _SUMMED:
      combined[name] = value_M.sum()
    elif name.endswith("_max"):
      combined[name] = value_M.max()
    elif name in _PER_OPTIMIZER_STEP:
      combined[name] = value_M.mean()
    else:
      tokens_M = metrics_M["off_tokens" if name.startswith("off_") else "on_tokens"]
      combined[name] = (value_M * tokens_M).sum() / jnp.maximum(tokens_M.sum(), 1)
  return combined


def combine_step_metrics(metrics_N: list[dict], policy_share_N, entropy_coeff: float) -> dict:
  """A training step's metrics (floats) from its N optimizer steps' (host values).

  Each mini-batch's losses are those of its own objective; scaled to shares of the
  whole step's (the policy loss by `policy_share_N`, `packing.policy_shares`; the entropy
  mean by the mini-batch's share of the step's tokens) they add up as micro-batches'
  do, and the rest follows `combine_metrics`.
  """
  m = {name: np.array([x[name] for x in metrics_N], np.float64) for name in metrics_N[0]}
  tokens_N = m["on_tokens"] + m["off_tokens"]
  for name in ("pg_loss", "on_pg_loss", "off_pg_loss"):
    m[name] = m[name] * np.asarray(policy_share_N)
  m["entropy"] = m["entropy"] * tokens_N / max(tokens_N.sum(), 1)
  m["loss"] = m["pg_loss"] - entropy_coeff * m["entropy"]
  return {name: float(value) for name, value in combine_metrics(m).items()}


def accumulate_gradients(params, batch: TrainBatch, frozen=None, *, cfg, algo, use_clip, chunk,
                         param_shardings=None):
  """Gradients of the mini-batch objective and its metrics, one micro-batch at a time
  (with respect to `params`: with `frozen`, see `_micro_loss`, the adapters)."""
  grad_fn = jax.grad(functools.partial(
      _micro_loss, cfg=cfg, algo=algo, use_clip=use_clip, chunk=chunk,
      num_tokens=jnp.maximum(batch.mask_MxBxR.sum(), 1)), has_aux=True)
  # Gradients are accumulated in the parameters' sharding (under FSDP, 1/n of them per
  # device); left to propagation, the zeros could come out replicated.
  constrain = (functools.partial(jax.lax.with_sharding_constraint, shardings=param_shardings)
               if param_shardings is not None else lambda tree: tree)
  micro_0 = jax.tree.map(lambda x: x[0], batch)
  nothing = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, micro_0, frozen))

  def accumulate(grads_acc, micro):
    # Packed mini-batches fill fewer micro-batches than the padded worst case they are
    # shaped for; the empty ones cost nothing.
    grads, metrics = jax.lax.cond(micro.mask_MxBxR.any(), grad_fn, lambda *_: nothing,
                                  params, micro, frozen)
    return constrain(jax.tree.map(jnp.add, grads_acc, grads)), metrics

  zeros = constrain(jax.tree.map(jnp.zeros_like, params))
  grads, metrics_M = jax.lax.scan(accumulate, zeros, batch)
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
  with sharding.use_mesh(mesh):
    if isinstance(params, lora.LoraParams):
      frozen = params.replace(adapters=None)
      adapters, opt_state, metrics = step_program(params.adapters, opt_state)(
          params.adapters, opt_state, batch, frozen, cfg=cfg, algo=algo, optim=optim,
          use_clip=use_clip, chunk=chunk)
      return params.replace(adapters=adapters), opt_state, metrics
    return step_program(params, opt_state)(params, opt_state, batch, cfg=cfg, algo=algo,
                                           optim=optim, use_clip=use_clip, chunk=chunk)


def step_program(params, opt_state):
  """The jitted step `train_step` runs for parameter and optimizer state with these
  shardings (arrays, or ShapeDtypeStructs when compiling ahead of time)."""
  flat, treedef = jax.tree.flatten(sharding.shardings_of((params, opt_state)))
  return _compiled_step(treedef, tuple(flat))


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


def _train_step(params, opt_state, batch: TrainBatch, frozen=None, *, cfg, algo, optim,
                use_clip, chunk, param_shardings):
  grads, metrics = accumulate_gradients(params, batch, frozen, cfg=cfg, algo=algo,
                                        use_clip=use_clip, chunk=chunk,
                                        param_shardings=param_shardings)
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
