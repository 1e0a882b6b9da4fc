"""Mixed on/off-policy policy-gradient losses (docs/algorithm.md §11), jitted.

Per valid token, with ratio r = exp(logp - old_logp) (old_logp: pi_old at the step's start
on fresh tokens, the rollout's or the learner's recompute per `algo.old_logp_source`; the
behaviour log-prob recorded at collection on replayed ones; all at temperature 1):
  fresh:    -r A, or max(-r A, -clip(r, 1-eps, 1+eps) A) with use_clip;
  replayed: -f(r) A with policy shaping f(w) = w / (w + gamma), never clipped; with
            shaping_gamma=None, the clipped ratio instead ("without policy shaping").
Truncated importance sampling of the rollout/learner mismatch (`tis_cap` = C > 0; off
with 0): a fresh token's term is multiplied by the constant w = min(exp(d), C), where
d = `rollout_log_ratio` = log pi_old - log pi_rollout of the token, both at the rollout
temperature (docs/algorithm.md §19). Replayed tokens are left as they are.
Aggregations (by name):
  token_sum_norm:      sum over valid tokens / norm_len (the constant L_max; Dr.GRPO).
  token_mean:          sum over valid tokens / number of valid tokens.
  seq_mean_token_mean: mean over sequences (with a valid token) of their token means.
A mini-batch split into micro-batches passes `weight_BxT`, each token's weight in the
whole mini-batch's aggregation (training/packing.token_weights), so the micro-batches'
losses sum exactly to the mini-batch's.

Metrics are plain names; the trainer prefixes them (e.g. "actor/"): pg_loss, on_pg_loss
and off_pg_loss (the fresh and replayed parts of pg_loss; they sum to it), pg_clipfrac and
off_pg_clipfrac (fraction of fresh / replayed tokens where the clipped term is taken),
on/off_ratio_mean and on/off_ratio_max, ppo_kl (mean old_logp - logp on fresh tokens) and
on_tokens / off_tokens. Given `rollout_log_ratio`, also mismatch_logp_abs_mean (mean |d|
on fresh tokens) and mismatch_ratio_max (max exp(d) on them), and with TIS on,
tis_clipfrac (fraction of fresh tokens whose weight is capped at C).

The registry holds `grpo` (clipped ratio on every token, no shaping) and `exgrpo` (the
switches as given), both calling `policy_loss`.
"""

import functools

import jax
import jax.numpy as jnp

from exgrpo_jax import registry

POLICY_LOSSES = registry.Registry("policy loss")
AGGREGATIONS = ("token_sum_norm", "token_mean", "seq_mean_token_mean")


def aggregate(loss_BxT, mask_BxT, aggregation: str, norm_len: float, weight_BxT=None):
  """Reduces per-token losses (zero where not counted) with `mask_BxT`'s denominators,
  or as `sum(weight_BxT * loss_BxT)` when per-token weights are given."""
  if weight_BxT is not None:
    return jnp.sum(loss_BxT * weight_BxT)
  mask_BxT = mask_BxT.astype(loss_BxT.dtype)
  if aggregation == "token_sum_norm":
    return loss_BxT.sum() / norm_len
  if aggregation == "token_mean":
    return loss_BxT.sum() / jnp.maximum(mask_BxT.sum(), 1)
  if aggregation == "seq_mean_token_mean":
    tokens_B = mask_BxT.sum(axis=1)
    seq_B = loss_BxT.sum(axis=1) / jnp.maximum(tokens_B, 1)
    return seq_B.sum() / jnp.maximum((tokens_B > 0).sum(), 1)
  raise ValueError(f"unknown loss aggregation {aggregation!r}; known: {AGGREGATIONS}")


def _masked_mean(x, mask):
  return jnp.where(mask, x, 0).sum() / jnp.maximum(mask.sum(), 1)


def _masked_max(x, mask):
  return jnp.where(mask.any(), jnp.where(mask, x, -jnp.inf).max(), 0)


@functools.partial(jax.jit, static_argnames=("clip_eps", "use_clip", "shaping_gamma",
                                             "norm_len", "aggregation", "tis_cap"))
def policy_loss(logp_BxT, old_logp_BxT, adv_B, mask_BxT, is_replay_BxT, *,
                clip_eps: float = 0.2, use_clip: bool = True,
                shaping_gamma: float | None = 0.1, norm_len: float = 8192.0,
                aggregation: str = "token_sum_norm", weight_BxT=None,
                rollout_log_ratio_BxT=None, tis_cap: float = 0.0):
  """The ExGRPO mixed policy loss; see the module docstring.

  Args:
    logp_BxT: log-probs of the taken tokens under the current parameters.
    old_logp_BxT: log-probs they are compared with (fresh: pi_old; replayed: pi_past).
    adv_B: per-sequence advantages, broadcast over tokens.
    mask_BxT: True on response tokens that count (EOS included).
    is_replay_BxT: True on replayed tokens.
    clip_eps: PPO clip range.
    use_clip: clip fresh tokens (before the delayed start).
    shaping_gamma: gamma of f(w) = w / (w + gamma) on replayed tokens; None = clip them.
    norm_len: the constant denominator of `token_sum_norm`.
    aggregation: one of AGGREGATIONS.
    weight_BxT: per-token weights replacing the aggregation's denominators (see above).
    rollout_log_ratio_BxT: log pi_old - log pi_rollout of each token at the rollout
      temperature (read on fresh tokens only), or None: no mismatch metrics, no TIS.
    tis_cap: C of the TIS weight min(exp(rollout_log_ratio), C) on fresh tokens; 0 = off.

  Returns:
    (scalar loss, dict of scalar metrics).
  """
  mask_BxT = mask_BxT.astype(bool)
  off_BxT = mask_BxT & is_replay_BxT.astype(bool)
  on_BxT = mask_BxT & ~off_BxT
  # Masking the log-ratio (not the loss) keeps padding garbage, even inf, out of the
  # gradient: exp() is then evaluated at 0 there.
  ratio_BxT = jnp.exp(jnp.where(mask_BxT, logp_BxT - old_logp_BxT, 0))
  adv_BxT = adv_B[:, None].astype(ratio_BxT.dtype)
  unclipped_BxT = -adv_BxT * ratio_BxT
  clipped_BxT = -adv_BxT * jnp.clip(ratio_BxT, 1 - clip_eps, 1 + clip_eps)
  ppo_BxT = jnp.maximum(unclipped_BxT, clipped_BxT)
  clip_taken_BxT = clipped_BxT > unclipped_BxT

  on_loss_BxT = ppo_BxT if use_clip else unclipped_BxT
  mismatch = {}
  if rollout_log_ratio_BxT is not None:
    log_ratio_BxT = jnp.where(on_BxT, rollout_log_ratio_BxT, 0).astype(ratio_BxT.dtype)
    is_ratio_BxT = jnp.exp(log_ratio_BxT)
    mismatch = dict(mismatch_logp_abs_mean=_masked_mean(jnp.abs(log_ratio_BxT), on_BxT),
                    mismatch_ratio_max=_masked_max(is_ratio_BxT, on_BxT))
    if tis_cap:
      on_loss_BxT = on_loss_BxT * jax.lax.stop_gradient(jnp.minimum(is_ratio_BxT, tis_cap))
      mismatch["tis_clipfrac"] = _masked_mean(is_ratio_BxT > tis_cap, on_BxT)
  elif tis_cap:
    raise ValueError("tis_cap needs rollout_log_ratio_BxT (the recomputed pi_old)")
  if shaping_gamma is None:
    off_loss_BxT = ppo_BxT
  else:
    off_loss_BxT = -adv_BxT * ratio_BxT / (ratio_BxT + shaping_gamma)
  on_part = aggregate(jnp.where(on_BxT, on_loss_BxT, 0), mask_BxT, aggregation, norm_len,
                      weight_BxT)
  off_part = aggregate(jnp.where(off_BxT, off_loss_BxT, 0), mask_BxT, aggregation, norm_len,
                       weight_BxT)
  loss = on_part + off_part

  metrics = dict(
      pg_loss=loss,
      on_pg_loss=on_part,
      off_pg_loss=off_part,
      pg_clipfrac=_masked_mean(clip_taken_BxT, on_BxT) if use_clip else jnp.zeros(()),
      off_pg_clipfrac=(_masked_mean(clip_taken_BxT, off_BxT) if shaping_gamma is None
                       else jnp.zeros(())),
      on_ratio_mean=_masked_mean(ratio_BxT, on_BxT),
      on_ratio_max=_masked_max(ratio_BxT, on_BxT),
      off_ratio_mean=_masked_mean(ratio_BxT, off_BxT),
      off_ratio_max=_masked_max(ratio_BxT, off_BxT),
      ppo_kl=_masked_mean(old_logp_BxT - logp_BxT, on_BxT),
      on_tokens=on_BxT.sum(),
      off_tokens=off_BxT.sum(),
      **mismatch,
  )
  return loss, metrics


@POLICY_LOSSES.register("exgrpo")
def exgrpo_loss(logp_BxT, old_logp_BxT, adv_B, mask_BxT, is_replay_BxT, **switches):
  """ExGRPO: the switches as given (shaping on replayed tokens by default)."""
  return policy_loss(logp_BxT, old_logp_BxT, adv_B, mask_BxT, is_replay_BxT, **switches)


@POLICY_LOSSES.register("grpo")
def grpo_loss(logp_BxT, old_logp_BxT, adv_B, mask_BxT, is_replay_BxT, **switches):
  """Plain clipped GRPO on every token (use_clip and shaping_gamma are overridden)."""
  switches.update(use_clip=True, shaping_gamma=None)
  return policy_loss(logp_BxT, old_logp_BxT, adv_B, mask_BxT, is_replay_BxT, **switches)
