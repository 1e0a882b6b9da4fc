"""Tests for exgrpo_jax.losses and exgrpo_jax.advantages against plain NumPy loops."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exgrpo_jax import advantages
from exgrpo_jax import losses

B, T = 5, 9
NORM_LEN = 16.0
EPS = 0.2


def _inputs(seed, dtype=np.float64):
  rng = np.random.default_rng(seed)
  logp = -rng.exponential(1.0, (B, T))
  old = logp + rng.normal(0, 0.4, (B, T))  # ratios spread over and beyond the clip range
  adv = rng.normal(0, 1, B)
  mask = rng.random((B, T)) < 0.7
  mask[2] = False  # a sequence with no valid token
  replay = rng.random((B, T)) < 0.4
  return [np.asarray(x, dtype) for x in (logp, old, adv)] + [mask, replay]


def _reference(logp, old, adv, mask, replay, use_clip, gamma, aggregation):
  """docs/algorithm.md §11, one token at a time, in float64."""
  loss = np.zeros((B, T))
  for b, t in itertools.product(range(B), range(T)):
    if not mask[b, t]:
      continue
    r, a = np.exp(logp[b, t] - old[b, t]), adv[b]
    clipped = max(-a * r, -a * min(max(r, 1 - EPS), 1 + EPS))
    if replay[b, t]:
      loss[b, t] = clipped if gamma is None else -a * r / (r + gamma)
    else:
      loss[b, t] = clipped if use_clip else -a * r
  return _aggregate(loss, mask, aggregation), loss


def _aggregate(loss, mask, aggregation):
  if aggregation == "token_sum_norm":
    return loss.sum() / NORM_LEN
  if aggregation == "token_mean":
    return loss.sum() / mask.sum()
  rows = [loss[b].sum() / mask[b].sum() for b in range(B) if mask[b].any()]
  return sum(rows) / len(rows)


SWITCHES = list(itertools.product([True, False], [None, 0.1, 1.0], losses.AGGREGATIONS))


@pytest.mark.parametrize("use_clip,gamma,aggregation", SWITCHES)
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-6), (np.float32, 1e-5)])
def test_policy_loss_matches_numpy(use_clip, gamma, aggregation, dtype, tol):
  inputs = _inputs(0, dtype)
  expected, token_loss = _reference(*[np.asarray(x, np.float64) if x.dtype != bool else x
                                      for x in inputs], use_clip, gamma, aggregation)
  with jax.enable_x64(dtype == np.float64):
    loss, metrics = losses.policy_loss(*inputs, clip_eps=EPS, use_clip=use_clip,
                                       shaping_gamma=gamma, norm_len=NORM_LEN,
                                       aggregation=aggregation)
    assert loss.dtype == dtype
    np.testing.assert_allclose(loss, expected, rtol=tol, atol=tol)
    metrics = jax.device_get(metrics)
  logp, old, adv, mask, replay = inputs
  on, off = mask & ~replay, mask & replay
  np.testing.assert_allclose(metrics["on_pg_loss"], _aggregate(token_loss * on, mask,
                                                               aggregation), atol=tol)
  np.testing.assert_allclose(metrics["off_pg_loss"], _aggregate(token_loss * off, mask,
                                                                aggregation), atol=tol)
  ratio = np.exp(logp.astype(np.float64) - old)
  clip_taken = (-adv[:, None] * np.clip(ratio, 1 - EPS, 1 + EPS)) > (-adv[:, None] * ratio)
  assert metrics["pg_clipfrac"] == pytest.approx(clip_taken[on].mean() if use_clip else 0,
                                                 abs=tol)
  assert metrics["off_pg_clipfrac"] == pytest.approx(
      clip_taken[off].mean() if gamma is None else 0, abs=tol)
  for name, sel in (("on", on), ("off", off)):
    assert metrics[f"{name}_ratio_mean"] == pytest.approx(ratio[sel].mean(), rel=tol)
    assert metrics[f"{name}_ratio_max"] == pytest.approx(ratio[sel].max(), rel=tol)
    assert metrics[f"{name}_tokens"] == sel.sum()
  assert metrics["ppo_kl"] == pytest.approx((old - logp)[on].mean(), rel=tol, abs=tol)


@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
def test_gradients_on_replayed_and_fresh_tokens(aggregation):
  logp, old, adv, mask, replay = _inputs(1)
  gamma = 0.1
  with jax.enable_x64(True):
    grad = jax.grad(lambda lp: losses.policy_loss(
        lp, old, adv, mask, replay, clip_eps=EPS, use_clip=False, shaping_gamma=gamma,
        norm_len=NORM_LEN, aggregation=aggregation)[0])(logp)
  w = np.exp(logp - old)
  a = adv[:, None]
  if aggregation == "token_sum_norm":
    scale = np.full((B, 1), 1 / NORM_LEN)
  elif aggregation == "token_mean":
    scale = np.full((B, 1), 1 / mask.sum())
  else:
    scale = 1 / (np.maximum(mask.sum(1, keepdims=True), 1) * mask.any(1).sum())
  expected = np.where(replay, -a * gamma * w / (w + gamma) ** 2, -a * w) * scale * mask
  np.testing.assert_allclose(grad, expected, rtol=1e-10, atol=1e-14)


def test_clipped_fresh_tokens_get_no_gradient():
  logp, old, adv, mask, replay = _inputs(2)
  replay[:] = False
  with jax.enable_x64(True):
    grad = jax.grad(lambda lp: losses.policy_loss(
        lp, old, adv, mask, replay, clip_eps=EPS, use_clip=True, norm_len=NORM_LEN)[0])(logp)
  r = np.exp(logp - old)
  a = adv[:, None]
  clipped = (a > 0) & (r > 1 + EPS) | (a < 0) & (r < 1 - EPS)
  assert (clipped & mask).any() and (~clipped & mask).any()
  np.testing.assert_allclose(grad, np.where(mask & ~clipped, -a * r / NORM_LEN, 0),
                             rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("use_clip,gamma,aggregation", [
    (True, None, "token_sum_norm"), (False, 0.1, "token_mean"),
    (True, 0.1, "seq_mean_token_mean"), (False, None, "token_sum_norm")])
def test_padding_never_changes_loss_or_gradient(use_clip, gamma, aggregation):
  logp, old, adv, mask, replay = _inputs(3, np.float32)
  rng = np.random.default_rng(4)
  garbage_logp = np.where(mask, logp, rng.normal(0, 50, (B, T))).astype(np.float32)
  garbage_old = np.where(mask, old, np.inf).astype(np.float32)
  garbage_replay = np.where(mask, replay, ~replay)
  kw = dict(clip_eps=EPS, use_clip=use_clip, shaping_gamma=gamma, norm_len=NORM_LEN,
            aggregation=aggregation)

  def value_and_grad(lp, o, rep):
    return jax.value_and_grad(lambda x: losses.policy_loss(x, o, adv, mask, rep, **kw)[0])(lp)

  loss_a, grad_a = value_and_grad(logp, old, replay)
  loss_b, grad_b = value_and_grad(garbage_logp, garbage_old, garbage_replay)
  assert loss_a == loss_b
  np.testing.assert_array_equal(grad_a, grad_b)
  assert (np.asarray(grad_b)[~mask] == 0).all()


TIS_CAP = 2.0


def _tis_inputs(seed):
  """Inputs with a rollout log-ratio whose exp lies above and below TIS_CAP on fresh
  tokens, and garbage (inf, nan) wherever it must not be read."""
  logp, old, adv, mask, replay = _inputs(seed)
  on = mask & ~replay
  log_ratio = np.random.default_rng(seed + 100).normal(0.3, 0.8, (B, T))
  ratio = np.exp(log_ratio[on])
  assert (ratio > TIS_CAP).any() and (ratio < 1).any() and ((ratio > 1) & (ratio < TIS_CAP)).any()
  log_ratio[mask & replay] = 50.0  # replayed tokens keep their own correction
  log_ratio[~mask] = np.where(np.arange(T) % 2, np.inf, np.nan)[None].repeat(B, 0)[~mask]
  return logp, old, adv, mask, replay, log_ratio


@pytest.mark.parametrize("use_clip,gamma,aggregation", [
    (True, 0.1, "token_sum_norm"), (False, None, "token_mean"),
    (False, 0.1, "seq_mean_token_mean")])
def test_tis_weighs_fresh_tokens_only_and_matches_numpy(use_clip, gamma, aggregation):
  """w = min(exp(log pi_old - log pi_rollout), C) multiplies each fresh token's term
  (clipped or not) and nothing else; it is a constant; the metrics are over fresh tokens."""
  logp, old, adv, mask, replay, log_ratio = _tis_inputs(8)
  _, token_loss = _reference(logp, old, adv, mask, replay, use_clip, gamma, aggregation)
  on = mask & ~replay
  weight = np.where(on, np.minimum(np.exp(np.where(on, log_ratio, 0)), TIS_CAP), 1.0)
  kw = dict(clip_eps=EPS, use_clip=use_clip, shaping_gamma=gamma, norm_len=NORM_LEN,
            aggregation=aggregation)
  with jax.enable_x64(True):
    loss_fn = lambda lp, lr: losses.policy_loss(lp, old, adv, mask, replay,
                                                rollout_log_ratio_BxT=lr, tis_cap=TIS_CAP,
                                                **kw)
    (loss, metrics), (grad_logp, grad_ratio) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(logp, log_ratio)
    plain_loss, plain_metrics = losses.policy_loss(logp, old, adv, mask, replay, **kw)
    off_loss, off_metrics = losses.policy_loss(logp, old, adv, mask, replay,
                                               rollout_log_ratio_BxT=log_ratio, **kw)
    (loss, metrics, grad_logp, grad_ratio, plain_loss, plain_metrics, off_loss,
     off_metrics) = jax.device_get((loss, metrics, grad_logp, grad_ratio, plain_loss,
                                    plain_metrics, off_loss, off_metrics))
  np.testing.assert_allclose(loss, _aggregate(token_loss * weight, mask, aggregation),
                             rtol=1e-10)
  np.testing.assert_allclose(metrics["on_pg_loss"],
                             _aggregate(token_loss * weight * on, mask, aggregation),
                             rtol=1e-10)
  assert metrics["off_pg_loss"] == plain_metrics["off_pg_loss"]
  assert (grad_ratio == 0).all()  # the weight is a constant
  ratio = np.exp(log_ratio[on])
  assert metrics["mismatch_logp_abs_mean"] == pytest.approx(np.abs(log_ratio[on]).mean())
  assert metrics["mismatch_ratio_max"] == pytest.approx(ratio.max())
  assert metrics["tis_clipfrac"] == pytest.approx((ratio > TIS_CAP).mean())
  # tis_cap = 0: the metrics without the weight.
  assert off_loss == plain_loss and "tis_clipfrac" not in off_metrics
  assert off_metrics["mismatch_ratio_max"] == metrics["mismatch_ratio_max"]
  assert "mismatch_ratio_max" not in plain_metrics
  if not use_clip:  # d/dlogp of -w r A is -w r A; replayed tokens' as without TIS
    a, r = adv[:, None], np.exp(logp - old)
    if aggregation == "token_mean":
      scale = 1 / mask.sum()
    else:
      scale = 1 / (np.maximum(mask.sum(1, keepdims=True), 1) * mask.any(1).sum())
    fresh = -a * r * weight
    clipped = (a > 0) & (r > 1 + EPS) | (a < 0) & (r < 1 - EPS)
    replayed = (np.where(clipped, 0, -a * r) if gamma is None
                else -a * gamma * r / (r + gamma) ** 2)
    expected = np.where(replay, replayed, fresh) * scale * mask
    np.testing.assert_allclose(grad_logp, expected, rtol=1e-10, atol=1e-14)


def test_tis_needs_the_rollout_log_ratio():
  logp, old, adv, mask, replay = _inputs(9, np.float32)
  with pytest.raises(ValueError, match="tis_cap needs rollout_log_ratio_BxT"):
    losses.policy_loss(logp, old, adv, mask, replay, tis_cap=TIS_CAP)


def test_identical_policies_give_ratio_one_on_fresh_tokens():
  logp, _, adv, mask, replay = _inputs(5, np.float32)
  loss, metrics = losses.policy_loss(logp, logp, adv, mask, replay, clip_eps=EPS,
                                     use_clip=True, shaping_gamma=0.1, norm_len=NORM_LEN)
  on = mask & ~replay
  assert metrics["on_ratio_mean"] == 1 and metrics["on_ratio_max"] == 1
  assert metrics["pg_clipfrac"] == 0
  np.testing.assert_allclose(metrics["on_pg_loss"], -(adv[:, None] * on).sum() / NORM_LEN,
                             rtol=1e-6)
  # Replayed tokens at w = 1 contribute f(1) = 1 / 1.1 of their advantage.
  np.testing.assert_allclose(metrics["off_pg_loss"],
                             -(adv[:, None] * (mask & replay)).sum() / 1.1 / NORM_LEN,
                             rtol=1e-6)
  np.testing.assert_allclose(loss, metrics["on_pg_loss"] + metrics["off_pg_loss"], rtol=1e-6)


def test_registry_switches():
  inputs = _inputs(6, np.float32)
  kw = dict(clip_eps=EPS, use_clip=False, shaping_gamma=0.1, norm_len=NORM_LEN,
            aggregation="token_sum_norm")
  grpo, _ = losses.POLICY_LOSSES.get("grpo")(*inputs, **kw)
  exgrpo, _ = losses.POLICY_LOSSES.get("exgrpo")(*inputs, **kw)
  np.testing.assert_allclose(grpo, losses.policy_loss(
      *inputs, **{**kw, "use_clip": True, "shaping_gamma": None})[0])
  np.testing.assert_allclose(exgrpo, losses.policy_loss(*inputs, **kw)[0])
  assert grpo != exgrpo
  with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
    losses.policy_loss(*inputs, **{**kw, "aggregation": "mean"})


def test_group_advantages():
  rng = np.random.default_rng(7)
  rewards = (rng.random((6, 8)) < 0.5).astype(np.float32)
  rewards[0] = 1  # all-correct group: zero advantage either way
  mean = rewards.mean(axis=1, keepdims=True)
  np.testing.assert_allclose(advantages.ADVANTAGES.get("group_mean")(rewards), rewards - mean,
                             atol=1e-7)
  std = np.array([np.std(row, ddof=1) for row in rewards])[:, None]
  np.testing.assert_allclose(advantages.ADVANTAGES.get("group_std")(rewards),
                             (rewards - mean) / (std + 1e-6), rtol=1e-6, atol=1e-6)
  # One replayed member (column 0) shares its group's mean with the K-1 fresh ones.
  mixed = jnp.asarray(rewards).at[:, 0].set(1.0)
  adv = advantages.group_mean(mixed)
  np.testing.assert_allclose(adv[:, 0], 1 - np.asarray(mixed).mean(axis=1), atol=1e-7)
  np.testing.assert_allclose(np.asarray(adv).sum(axis=1), 0, atol=1e-6)
  np.testing.assert_array_equal(advantages.group_std(rewards[:, :1]), rewards[:, :1])
  with pytest.raises(ValueError, match="one row per group"):
    advantages.group_mean(rewards.reshape(-1))
