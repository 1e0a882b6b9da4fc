"""Numerical check of ExGRPO's Theorem 1 on a toy tabular policy (paper App. D).

Policy: length-3 sequences over 3 tokens, pi_theta(o_t | o_<t) = softmax(theta[o_<t]) with
one logit row per prefix (13 rows). Every sequence can be enumerated (27), so exact
expectations are sums; Monte Carlo runs over 200,000 mixed groups with a fixed seed.

A mixed group holds one replayed o* ~ pi_past and K-1 fresh o_i ~ pi_theta; with
A(o, G) = r(o) - mean_G(r) and score s(o) = grad log pi_theta(o), the estimator is
  G_exp = (1/K) [ W(o*) s(o*) A(o*, G) + sum_i s(o_i) A(o_i, G) ],  W = pi_theta / pi_past.
Its expectation must equal the on-policy one, E[(1/K) sum_i s(o_i) A(o_i, G)] over K fresh
members, which is (1 - 1/K) grad J since E[s] = 0.

The estimator ExGRPO actually uses replaces W(o*) s(o*) by the token-level shaped term
sum_t f'(w_t) w_t grad log pi_theta(o*_t), f(w) = w / (w + gamma). It is biased by design;
the test measures that bias and prints it.
"""

import itertools

import numpy as np

V, L, K, GAMMA = 3, 3, 8, 0.1
NUM_SAMPLES = 200_000
SEQS = np.array(list(itertools.product(range(V), repeat=L)))  # [27, L]


def _prefix_index(prefix) -> int:
  """Row of theta for a prefix: 0 for the empty one, then all of length 1, then 2."""
  offset = sum(V ** n for n in range(len(prefix)))
  return offset + (int(np.ravel_multi_index(prefix, (V,) * len(prefix))) if prefix else 0)


NUM_PREFIXES = sum(V ** n for n in range(L))
ROWS = np.array([[_prefix_index(tuple(s[:t])) for t in range(L)] for s in SEQS])  # [27, L]


def _token_probs(theta):
  """pi(o_t | o_<t) for every sequence and position, and the full softmax rows."""
  softmax = np.exp(theta - theta.max(axis=1, keepdims=True))
  softmax /= softmax.sum(axis=1, keepdims=True)
  return softmax[ROWS, SEQS], softmax


def _token_scores(theta):
  """grad_theta log pi(o_t | o_<t), [27, L, NUM_PREFIXES * V]."""
  _, softmax = _token_probs(theta)
  scores = np.zeros((len(SEQS), L, NUM_PREFIXES, V))
  for n, t in itertools.product(range(len(SEQS)), range(L)):
    row = ROWS[n, t]
    scores[n, t, row] = -softmax[row]
    scores[n, t, row, SEQS[n, t]] += 1
  return scores.reshape(len(SEQS), L, -1)


def _setup():
  rng = np.random.default_rng(0)
  theta = rng.normal(0, 0.7, (NUM_PREFIXES, V))
  theta_past = theta + rng.normal(0, 0.5, theta.shape)  # the behaviour policy
  token_p, _ = _token_probs(theta)
  token_p_past, _ = _token_probs(theta_past)
  reward = (SEQS.sum(axis=1) % 3 == 0).astype(float)
  scores = _token_scores(theta)
  return dict(rng=rng, p=token_p.prod(1), p_past=token_p_past.prod(1),
              w_tok=token_p / token_p_past, reward=reward, scores=scores,
              seq_scores=scores.sum(axis=1))


def _exact_on_policy(s):
  grad_j = (s["p"] * s["reward"]) @ s["seq_scores"]
  return (1 - 1 / K) * grad_j


def _exact_mixed(s, replay_term):
  """Exact expectation of (1/K)[replay_term(o*) A(o*, G) + sum_i s(o_i) A(o_i, G)].

  The fresh members are independent of o*: E[A(o*, G) | o*] = (1 - 1/K) r* - (K-1)/K mu,
  and a fresh member's score correlates only with its own reward, (1 - 1/K) r_i.
  """
  mu = s["p"] @ s["reward"]
  a_star = (1 - 1 / K) * s["reward"] - (K - 1) / K * mu
  replay = (s["p_past"] * a_star) @ replay_term
  fresh = (K - 1) * (1 - 1 / K) * ((s["p"] * s["reward"]) @ s["seq_scores"])
  return (replay + fresh) / K


def _monte_carlo(s, star_p, replay_term, std=False):
  """Per-group estimates [N, P]: member 0 ~ star_p enters through replay_term[o*], the
  K-1 others ~ pi_theta through their scores; A = r - mean (/ (std + 1e-6) with std)."""
  rng = s["rng"]
  star = rng.choice(len(SEQS), NUM_SAMPLES, p=star_p)
  fresh = rng.choice(len(SEQS), (NUM_SAMPLES, K - 1), p=s["p"])
  rewards = s["reward"][np.concatenate([star[:, None], fresh], axis=1)]
  adv = rewards - rewards.mean(axis=1, keepdims=True)
  if std:
    adv /= rewards.std(axis=1, ddof=1, keepdims=True) + 1e-6
  weights = np.zeros((NUM_SAMPLES, len(SEQS)))  # how much each sequence's score enters
  np.add.at(weights, (np.repeat(np.arange(NUM_SAMPLES), K - 1), fresh.ravel()),
            adv[:, 1:].ravel())
  estimates = weights @ s["seq_scores"] + adv[:, :1] * replay_term[star]
  return estimates / K


def _mean_and_se(estimates):
  return estimates.mean(axis=0), estimates.std(axis=0) / np.sqrt(len(estimates))


def _is_term(s):
  return (s["p"] / s["p_past"])[:, None] * s["seq_scores"]  # W(o*) s(o*)


def test_trajectory_level_is_mixed_group_gradient_is_unbiased():
  s = _setup()
  target = _exact_on_policy(s)
  np.testing.assert_allclose(_exact_mixed(s, _is_term(s)), target, atol=1e-12)
  mean, se = _mean_and_se(_monte_carlo(s, s["p_past"], _is_term(s)))
  assert np.linalg.norm(target) > 100 * np.linalg.norm(se)  # the test can resolve it
  assert (np.abs(mean - target) < 4 * se).all(), np.abs(mean - target) / se
  # Power: without the importance weight the same test sees the bias.
  mean, se = _mean_and_se(_monte_carlo(s, s["p_past"], s["seq_scores"]))
  assert (np.abs(mean - target) > 6 * se).any()


def test_unbiased_with_group_std_normalisation():
  """Theorem 1 holds with the group-dependent std too: mixed vs on-policy Monte Carlo."""
  s = _setup()
  on_mean, on_se = _mean_and_se(_monte_carlo(s, s["p"], s["seq_scores"], std=True))
  mixed_mean, mixed_se = _mean_and_se(_monte_carlo(s, s["p_past"], _is_term(s), std=True))
  tolerance = 4 * np.hypot(on_se, mixed_se)
  assert (np.abs(mixed_mean - on_mean) < tolerance).all()
  biased_mean, biased_se = _mean_and_se(_monte_carlo(s, s["p_past"], s["seq_scores"],
                                                     std=True))
  assert (np.abs(biased_mean - on_mean) > 6 * np.hypot(on_se, biased_se)).any()


def test_token_level_shaped_estimator_bias_is_measured():
  s = _setup()
  target = _exact_on_policy(s)
  w = s["w_tok"]
  shaped = np.einsum("nt,ntp->np", GAMMA * w / (w + GAMMA) ** 2, s["scores"])
  token_is = np.einsum("nt,ntp->np", w, s["scores"])
  report = {}
  for name, term in (("shaped f(w_t)", shaped), ("token-level w_t", token_is)):
    exact = _exact_mixed(s, term)
    mean, se = _mean_and_se(_monte_carlo(s, s["p_past"], term))
    assert (np.abs(mean - exact) < 4 * se).all()  # the exact expectation is right
    assert (np.abs(mean - target) > 6 * se).any()  # and the bias is real
    # The replayed member alone: K E[mixed] - (K-1) E[fresh member] vs one on-policy member.
    member = K * exact - (K - 1) * target
    report[name] = dict(group_relative_bias=_relative_error(exact, target),
                        group_cosine=_cosine(exact, target),
                        member_relative_bias=_relative_error(member, target),
                        member_cosine=_cosine(member, target))
  print("\nbias of the mixed-group gradient vs the on-policy expectation:", report)
  assert report["shaped f(w_t)"]["group_cosine"] > 0


def _relative_error(x, reference):
  return float(np.linalg.norm(x - reference) / np.linalg.norm(reference))


def _cosine(x, y):
  return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))


def test_theorem_1_on_the_policy_loss_itself():
  """Theorem 1 through `losses.policy_loss`: exact expectations over every group.

  One-token responses (so the per-token ratio is the trajectory weight W) over V = 3
  tokens, K = 4: every group of one replayed o* ~ pi_past and K-1 fresh o_i ~ pi_theta
  is enumerated (3^4) with its probability folded into the advantages, and the loss is
  differentiated in theta. With the importance weight unclipped and unshaped, the
  mixed groups' expected gradient equals the on-policy groups' (the same loss with K
  fresh members), which is (1 - 1/K) grad J; with W := 1 it does not.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import losses  # pylint: disable=g-import-not-at-top

  v, k = 3, 4
  rng = np.random.default_rng(0)
  theta = jnp.asarray(rng.normal(0, 0.7, v), jnp.float32)
  logp_past_V = jax.nn.log_softmax(jnp.asarray(rng.normal(0, 0.7, v), jnp.float32))
  reward_V = jnp.array([1.0, 0.0, 1.0])
  groups_GxK = np.array(list(itertools.product(range(v), repeat=k)))  # [81, K]

  def expected_loss(theta, replayed: bool, weighted: bool = True):
    logp_V = jax.nn.log_softmax(theta)
    tokens_N = groups_GxK.reshape(-1)
    logp_Nx1 = logp_V[tokens_N][:, None]
    is_replay_GxK = np.zeros(groups_GxK.shape, bool)
    is_replay_GxK[:, 0] = replayed
    is_replay_Nx1 = is_replay_GxK.reshape(-1, 1)
    old_Nx1 = jnp.where(is_replay_Nx1, logp_past_V[tokens_N][:, None] if weighted
                        else jax.lax.stop_gradient(logp_Nx1),
                        jax.lax.stop_gradient(logp_Nx1))
    member_p_GxK = jax.lax.stop_gradient(
        jnp.where(is_replay_GxK, jnp.exp(logp_past_V)[groups_GxK],
                  jnp.exp(logp_V)[groups_GxK]))
    rewards_GxK = reward_V[groups_GxK]
    adv_GxK = rewards_GxK - rewards_GxK.mean(axis=1, keepdims=True)
    adv_N = (adv_GxK * member_p_GxK.prod(axis=1, keepdims=True)).reshape(-1)
    loss, _ = losses.policy_loss(logp_Nx1, old_Nx1, adv_N, np.ones((len(adv_N), 1), bool),
                                 is_replay_Nx1, clip_eps=1e9, use_clip=False,
                                 shaping_gamma=None, norm_len=float(k))
    return loss

  grad_j = jax.grad(lambda t: jnp.exp(jax.nn.log_softmax(t)) @ reward_V)(theta)
  on_policy = -jax.grad(expected_loss)(theta, False)
  mixed = -jax.grad(expected_loss)(theta, True)
  np.testing.assert_allclose(on_policy, (1 - 1 / k) * grad_j, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(mixed, on_policy, rtol=1e-5, atol=1e-7)
  unweighted = -jax.grad(expected_loss)(theta, True, False)
  assert np.abs(unweighted - on_policy).max() > 100 * 1e-5 * np.abs(on_policy).max()
