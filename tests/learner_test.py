"""The learner's optimizer step computes docs/algorithm.md §11-§12 over the whole mini-batch.

The gradient (and the logged losses) of one step must not depend on how the mini-batch
is split into micro-batches; the reference is the objective written out directly: each
response run alone through the model with full logits, its per-token loss (§11), the
aggregation over the whole mini-batch and the entropy bonus's mean over all its tokens.
Likewise a training step's metrics must not depend on its split into mini-batches.
"""

import functools
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import tiny
from exgrpo_jax import losses
from exgrpo_jax import models
from exgrpo_jax.training import actor
from exgrpo_jax.training import groups as groups_lib
from exgrpo_jax.training import learner
from exgrpo_jax.training import packing

CFG = models.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, eos_token_id=(1,))
N, P, R = 6, 8, 12
GAMMA, EPS = 0.1, 0.2
# Large enough that a wrongly scaled entropy bonus moves the gradient far beyond round-off.
ENTROPY_COEFF = 0.1


def _algo(aggregation):
  return learner.frozen(ml_collections.ConfigDict(dict(
      loss="exgrpo", clip_eps=EPS, shaping_gamma=GAMMA, norm_len=R,
      aggregation=aggregation, entropy_coeff=ENTROPY_COEFF, tis_cap=0.0)))


def _responses():
  rng = np.random.default_rng(0)
  out = []
  for i in range(N):
    n = R if i == 0 else int(rng.integers(1, R))  # one response at the cap
    out.append(dict(prompt=rng.integers(2, 96, int(rng.integers(1, P + 1))),
                    tokens=rng.integers(2, 96, n), old_logp=rng.normal(-4.5, 0.3, n),
                    adv=float(rng.normal()), is_replay=bool(i % 3 == 2)))
  return out


RESPONSES = _responses()


def _batch(micro, aggregation="token_sum_norm", pack=True, prompt_len=P):
  """The mini-batch as micro-batches of `micro` rows, shaped for one response per row,
  each row with `prompt_len` + R tokens."""
  responses = [packing.Sequence(r["prompt"], r["tokens"], r["old_logp"], r["adv"],
                                r["is_replay"]) for r in RESPONSES]
  return packing.train_batch(responses, prompt_len=prompt_len, response_len=R,
                             micro_batch=micro, num_micro=-(-N // micro), pad_id=0,
                             aggregation=aggregation, norm_len=R, pack=pack)


@functools.partial(jax.jit, static_argnames=("algo",))
def _gradients(params, batch, algo):
  return learner.accumulate_gradients(params, batch, cfg=CFG, algo=algo, use_clip=True,
                                      chunk=5)


def _tokens():
  """RESPONSES laid out one per row, and, per scored token, its (row, column, advantage,
  old log-prob, is_replay, sequence).

  Each response sits at the start of its own row, right-padded with token 0: causal
  attention keeps the padding out of the response's logits, so no mask is needed.
  """
  tokens_NxL = np.zeros((N, P + R), np.int32)
  row, col, replay, adv, old = [], [], [], [], []
  for i, r in enumerate(RESPONSES):
    ids = np.concatenate([r["prompt"], r["tokens"]])
    tokens_NxL[i, :len(ids)] = ids
    n = len(r["tokens"])
    row += [i] * n
    col += list(range(len(r["prompt"]), len(ids)))  # the scored tokens' columns
    replay += [r["is_replay"]] * n
    adv += [r["adv"]] * n
    old += list(r["old_logp"])
  seq_of_token = np.repeat(np.arange(N), [len(r["tokens"]) for r in RESPONSES])
  return tokens_NxL, *map(np.asarray, (row, col, adv, old, replay)), seq_of_token


def _per_token(params):
  """Log-probs and entropies of every scored token (full logits), and the token data."""
  tokens_NxL, row, col, adv, old, replay, seq = _tokens()
  logits_NxLxV = models.apply(CFG, params, jnp.asarray(tokens_NxL))[0]
  logp_all_KxV = jax.nn.log_softmax(logits_NxLxV[row, col - 1])
  logp_K = logp_all_KxV[np.arange(len(row)), tokens_NxL[row, col]]
  entropy_K = -jnp.sum(jnp.exp(logp_all_KxV) * logp_all_KxV, axis=1)
  return logp_K, entropy_K, adv, old, replay, seq


def _pg_terms(logp_K, adv, old, replay):
  """Per-token policy losses (clipped fresh, shaped replayed), ratios, clip taken."""
  ratio_K = jnp.exp(logp_K - old)
  shaped_K = -adv * ratio_K / (ratio_K + GAMMA)
  unclipped_K, clipped_K = -adv * ratio_K, -adv * jnp.clip(ratio_K, 1 - EPS, 1 + EPS)
  loss_K = jnp.where(replay, shaped_K, jnp.maximum(unclipped_K, clipped_K))
  return loss_K, ratio_K, clipped_K > unclipped_K


def _aggregate(loss_K, seq, aggregation):
  if aggregation == "token_sum_norm":
    return loss_K.sum() / R
  if aggregation == "token_mean":
    return loss_K.mean()
  lengths = np.bincount(seq, minlength=N)
  return (jax.ops.segment_sum(loss_K, seq, N) / lengths).mean()


def _reference(aggregation):
  """(objective, (pg_loss, entropy)) of docs/algorithm.md §11-§12 over the mini-batch, and
  its gradient."""

  def objective(params):
    logp_K, entropy_K, adv, old, replay, seq = _per_token(params)
    pg_loss = _aggregate(_pg_terms(logp_K, adv, old, replay)[0], seq, aggregation)
    entropy = entropy_K.mean()
    return pg_loss - ENTROPY_COEFF * entropy, (pg_loss, entropy)

  params = models.init_params(CFG, jax.random.key(0))
  return jax.jit(jax.value_and_grad(objective, has_aux=True))(params)


def _direct_metrics(aggregation):
  """Every token metric of the step computed directly over all of RESPONSES at once."""
  params = models.init_params(CFG, jax.random.key(0))
  logp_K, entropy_K, adv, old, replay, seq = map(np.asarray, _per_token(params))
  loss_K, ratio_K, clip_K = map(np.asarray, _pg_terms(logp_K, adv, old, replay))
  on, off = ~replay, replay
  pg = {name: float(_aggregate(np.where(mask, loss_K, 0), seq, aggregation))
        for name, mask in (("on_pg_loss", on), ("off_pg_loss", off))}
  pg["pg_loss"] = pg["on_pg_loss"] + pg["off_pg_loss"]
  return dict(pg, entropy=entropy_K.mean(),
              loss=pg["pg_loss"] - ENTROPY_COEFF * entropy_K.mean(),
              on_tokens=on.sum(), off_tokens=off.sum(),
              on_ratio_mean=ratio_K[on].mean(), on_ratio_max=ratio_K[on].max(),
              off_ratio_mean=ratio_K[off].mean(), off_ratio_max=ratio_K[off].max(),
              ppo_kl=(old - logp_K)[on].mean(), pg_clipfrac=clip_K[on].mean(),
              off_pg_clipfrac=0.0)


# 4: the last micro-batch has padding rows. Every micro-batch size, packed and padded,
# shares the default aggregation's compile budget; the others check one split each.
@pytest.mark.parametrize("aggregation,splits", [
    ("token_sum_norm", [(1, False), (2, False), (4, False), (N, False), (2, True),
                        (N, True)]),
    ("token_mean", [(4, True)]), ("seq_mean_token_mean", [(4, True)])])
def test_gradient_does_not_depend_on_micro_batch_size_or_packing(aggregation, splits):
  assert set(losses.AGGREGATIONS) == {"token_sum_norm", "token_mean", "seq_mean_token_mean"}
  params = models.init_params(CFG, jax.random.key(0))
  (objective, (pg_loss, entropy)), expected = _reference(aggregation)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(expected))
  for micro, pack in splits:
    grads, metrics = _gradients(params, _batch(micro, aggregation, pack), _algo(aggregation))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
      np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale, err_msg=f"{micro=} {pack=}")
    np.testing.assert_allclose(metrics["loss"], objective, rtol=1e-5)
    np.testing.assert_allclose(metrics["pg_loss"], pg_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["entropy"], entropy, rtol=1e-5)


def test_gradient_does_not_depend_on_the_rows_prompt_budget():
  """`train.prompt_bucket` sets the rows' prompt budget (`padding.prompt_bucket`): wider
  rows pack otherwise, and the gradient stays the reference's."""
  params = models.init_params(CFG, jax.random.key(0))
  _, expected = _reference("token_sum_norm")
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(expected))
  for prompt_len in (P, P + 3, 2 * P):
    grads, _ = _gradients(params, _batch(2, prompt_len=prompt_len), _algo("token_sum_norm"))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
      np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale, err_msg=f"{prompt_len=}")


def test_step_metrics_do_not_depend_on_micro_batch_size():
  optim = ml_collections.ConfigDict(dict(lr=1e-3, weight_decay=0.01, b1=0.9, b2=0.999,
                                         eps=1e-8, grad_clip=1.0, skip_grad_norm=500.0))
  tx = learner.make_optimizer(optim)
  results = []
  for micro in (1, N):
    params = models.init_params(CFG, jax.random.key(0))
    _, _, metrics = learner.train_step(
        params, tx.init(params), _batch(micro), cfg=CFG,
        algo=_algo("token_sum_norm"), optim=learner.frozen(optim), use_clip=True, chunk=5)
    results.append(jax.device_get(metrics))
  for name in results[0]:
    np.testing.assert_allclose(results[0][name], results[1][name], rtol=2e-5, atol=1e-7,
                               err_msg=name)


@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
def test_token_weights_reproduce_the_aggregation(aggregation):
  rng = np.random.default_rng(1)
  loss_NxR = rng.normal(size=(N, R)).astype(np.float32)
  mask_NxR = rng.random((N, R)) < 0.6
  mask_NxR[3] = False  # a row without loss tokens (a padding row)
  loss_NxR = np.where(mask_NxR, loss_NxR, 0)
  weight_NxR = packing.token_weights(mask_NxR, aggregation, 16.0)
  np.testing.assert_allclose(np.sum(weight_NxR * loss_NxR),
                             losses.aggregate(loss_NxR, mask_NxR, aggregation, 16.0), rtol=1e-6)


@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
def test_policy_shares_make_mini_batch_losses_add_up_to_the_whole(aggregation):
  rng = np.random.default_rng(2)
  lengths = rng.integers(0, R + 1, 10)
  loss_NxR = rng.normal(size=(10, R)) * (np.arange(R) < lengths[:, None])
  parts = np.array_split(rng.permutation(10), 3)
  part_losses = [losses.aggregate(loss_NxR[p], np.arange(R) < lengths[p, None],
                                  aggregation, 16.0) for p in parts]
  shares = packing.policy_shares(lengths, parts, aggregation, 16.0)
  np.testing.assert_allclose(np.dot(shares, part_losses), losses.aggregate(
      loss_NxR, np.arange(R) < lengths[:, None], aggregation, 16.0), rtol=1e-5)


# The other aggregations differ from the default only in `packing.policy_shares`, tested
# above on its own.
@pytest.mark.parametrize("aggregation", [
    "token_sum_norm", pytest.param("token_mean", marks=pytest.mark.slow),
    pytest.param("seq_mean_token_mean", marks=pytest.mark.slow)])
def test_training_step_metrics_are_those_of_the_whole_step(aggregation):
  """Actor.update with 1 and 2 mini-batches on the same data reports the metrics of the
  whole step computed directly: token means over the step's tokens (a mini-batch
  without replayed tokens adds nothing to the off_* means), maxima over all tokens,
  token counts and losses of the whole step. Every optimizer step is skipped (a grad
  norm limit of 1e-30), so both mini-batches see the same parameters."""
  config = tiny.get_config()
  config.algo.update(loss="exgrpo", clip_eps=EPS, shaping_gamma=GAMMA, norm_len=R,
                     aggregation=aggregation, entropy_coeff=ENTROPY_COEFF)
  config.rollout.max_new_tokens = R
  config.train.logprob_chunk = 5
  config.optim.update(skip_grad_norm=1e-30, micro_batch_size=2)
  groups = [types.SimpleNamespace(
      prompt_ids=list(r["prompt"]),
      responses=[groups_lib.Response(r["tokens"], r["old_logp"].astype(np.float32), "",
                                     is_replay=r["is_replay"])],
      advantages=np.array([r["adv"]])) for r in RESPONSES]
  # Seed 0 orders the responses so that the replayed ones (2 and 5) share the first of
  # two mini-batches: the second has no replayed token.
  first, _ = np.array_split(np.random.default_rng(0).permutation(N), 2)
  assert {2, 5} <= set(first.tolist())
  want = _direct_metrics(aggregation)
  for mini_batches in (1, 2):
    config.optim.mini_batches = mini_batches
    act = actor.Actor(config, CFG, pad_id=0)
    params = models.init_params(CFG, jax.random.key(0))
    opt_state = learner.make_optimizer(config.optim).init(params)
    _, _, got = act.update(params, opt_state, groups, True, np.random.default_rng(0))
    assert got["skipped"] == mini_batches
    for name, value in want.items():
      np.testing.assert_allclose(got[name], value, rtol=2e-5, atol=1e-7,
                                 err_msg=f"{name}, {mini_batches} mini-batch(es)")
