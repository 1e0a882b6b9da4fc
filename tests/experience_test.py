"""Replay-side selection: the lowest-entropy pick under the current policy, and its savings.

A tiny random model scores real stored trajectories; the reference is each candidate
scored alone (batch of one) and a NumPy mean over its tokens.
"""

import jax
import numpy as np
import pytest

from exgrpo_jax import models
from exgrpo_jax.replay import buffer as buffer_lib
from exgrpo_jax.training import experience

CFG = models.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16)
R = 12
PROMPTS = {0: [5, 6, 7], 1: [8, 9], 2: [10, 11, 12, 13]}


@pytest.fixture(scope="module")
def setup():
  params = models.init_params(CFG, jax.random.key(0))
  rng = np.random.default_rng(0)
  buf = buffer_lib.ExperienceBuffer(dict(k=4, vocab_size=CFG.vocab_size))
  groups, rewards = [], []
  # Questions 0 and 2 get three correct responses each; question 1 gets one.
  for correct in (3, 1, 3):
    group = []
    for _ in range(4):
      n = int(rng.integers(3, R))
      group.append((rng.integers(20, 120, n).astype(np.int32),
                    -rng.random(n).astype(np.float32)))
    groups.append(group)
    rewards.append([1.0] * correct + [0.0] * (4 - correct))
  buf.update([0, 1, 2], np.array(rewards), groups, step=1)
  return params, buf


def _choose(setup, need_current_logp=False, batch_size=8):
  params, buf = setup
  return experience.choose_replays(
      buf, [0, 1, 2], lambda q: PROMPTS[q], cfg=CFG, params=params, rule="lowest_entropy",
      max_new_tokens=R, batch_size=batch_size, pad_id=0, chunk=4,
      rng=np.random.default_rng(0), need_current_logp=need_current_logp)


def test_picks_lowest_mean_entropy_under_current_policy(setup):
  params, buf = setup
  replays = _choose(setup)
  for rep, qid in zip(replays, (0, 1, 2)):
    candidates = buf.candidates(qid)
    assert rep.num_candidates == len(candidates)
    means = []
    for traj in candidates:  # each alone: batch of one, its own padding
      s = experience.score_rows(
          [(PROMPTS[qid], np.asarray(traj.token_ids), None)], cfg=CFG, params=params,
          max_new_tokens=R, batch_size=1, pad_id=0, chunk=4)
      means.append(float((s.entropy_SxR * s.mask_SxR).sum() / s.mask_SxR.sum()))
    best = candidates[int(np.argmin(means))]
    np.testing.assert_array_equal(rep.tokens, best.token_ids)
    np.testing.assert_array_equal(rep.behaviour_logp, best.logps)


def test_single_candidate_is_not_scored_unless_needed(setup):
  params, buf = setup
  lean, full = _choose(setup), _choose(setup, need_current_logp=True)
  assert lean[1].num_candidates == 1 and lean[1].current_logp is None
  assert all(r.current_logp is not None for r in full)
  for rep in full:  # current log-probs: the same tokens scored alone
    s = experience.score_rows(
        [(PROMPTS[rep.question_id], rep.tokens, None)], cfg=CFG, params=params,
        max_new_tokens=R, batch_size=1, pad_id=0, chunk=4)
    np.testing.assert_allclose(rep.current_logp, s.logp_SxR[0, :int(s.mask_SxR.sum())],
                               atol=1e-5)
  for a, b in zip(lean, full):
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_scoring_batches_shrink_to_powers_of_two():
  sizes = [experience._batch_size_for(n, 8) for n in (1, 2, 3, 5, 8, 9, 100)]
  assert sizes == [1, 2, 4, 8, 8, 8, 8]
