"""Tests for exgrpo_jax.replay: bucket sampling statistics, update rules, caps, storage,
checkpoint round trips and trajectory selection."""

import io

import numpy as np
import pytest
from scipy import stats

from exgrpo_jax import replay
from exgrpo_jax.replay import buckets
from exgrpo_jax.replay import selection
from exgrpo_jax.replay import storage

K = 8
V = 152064


def _traj(rng, length=None, vocab=V):
  length = length or int(rng.integers(1, 30))
  return (rng.integers(0, vocab, length), -rng.exponential(2.0, length).astype(np.float32))


def _group(rng, num_correct, k=K):
  """Rewards with `num_correct` ones and K fresh random trajectories."""
  rewards = np.zeros(k)
  rewards[rng.permutation(k)[:num_correct]] = 1.0
  return rewards, [_traj(rng) for _ in range(k)]


def _filled_buffer(per_bucket, seed=0, **config):
  """A buffer with `per_bucket[b]` questions in bucket b (b = 1..K-1)."""
  rng = np.random.default_rng(seed)
  buf = replay.ExperienceBuffer(dict(k=K, vocab_size=V, **config), seed=seed)
  qid = 0
  for b, n in per_bucket.items():
    groups = [_group(rng, b) for _ in range(n)]
    buf.update(np.arange(qid, qid + n), np.stack([g[0] for g in groups]),
               [g[1] for g in groups], step=0)
    qid += n
  return buf


def test_gaussian_bucket_probs_match_reference_table():
  sizes = np.array([0] + [5] * 7 + [0])
  probs = buckets.bucket_probs(sizes, mu=0.5, sigma=1 / K)
  expected = stats.norm.pdf(np.arange(1, 8), loc=4, scale=1)
  np.testing.assert_allclose(probs[1:8], expected / expected.sum(), rtol=1e-12)
  np.testing.assert_allclose(probs[1:8], [0.0044, 0.054, 0.242, 0.399, 0.242, 0.054, 0.0044],
                             atol=6e-4)
  assert probs[0] == probs[8] == 0
  # Empty buckets get nothing; the rest renormalise.
  sizes[4] = 0
  probs = buckets.bucket_probs(sizes, mu=0.5, sigma=1 / K)
  assert probs[4] == 0 and np.isclose(probs.sum(), 1)
  # A width far too narrow for every non-empty bucket still gives a distribution.
  probs = buckets.bucket_probs(np.array([0, 3, 0, 0, 0, 0, 0, 3, 0]), mu=0.5, sigma=1e-3)
  np.testing.assert_allclose(probs[[1, 7]], [0.5, 0.5])


@pytest.mark.parametrize("weighting", ["gaussian", "uniform", "proportional"])
def test_sample_questions_follows_bucket_weights_chi_square(weighting):
  per_bucket = {1: 150, 2: 80, 3: 150, 4: 150, 5: 100, 6: 150, 7: 150}
  buf = _filled_buffer(per_bucket, weighting=weighting)
  bucket_of = {q: buf.bucket(q) for q in range(sum(per_bucket.values()))}
  sizes = np.array([0] + list(per_bucket.values()) + [0])
  if weighting == "gaussian":
    weights = stats.norm.pdf(np.arange(1, 8), loc=4, scale=1)
  elif weighting == "uniform":
    weights = np.ones(7)
  else:
    weights = sizes[1:8].astype(float)
  expected_p = weights / weights.sum()
  hist = np.zeros(K + 1, int)
  for _ in range(400):
    qids = buf.sample_questions(16)  # far below every bucket size: no capping
    assert len(set(qids.tolist())) == 16
    for q in qids:
      hist[bucket_of[q]] += 1
  _, p_value = stats.chisquare(hist[1:8], expected_p * hist.sum())
  assert p_value > 1e-3, (hist, expected_p * hist.sum())


def test_questions_are_uniform_within_a_bucket():
  buf = _filled_buffer({3: 40, 4: 1})
  hist = np.zeros(41, int)
  for _ in range(2000):
    for q in buf.sample_questions(5):
      hist[q] += 1
  _, p_value = stats.chisquare(hist[:40])
  assert p_value > 1e-3


def test_capped_multinomial_hands_surplus_over_in_proportion():
  rng = np.random.default_rng(0)
  probs, sizes, n = np.array([0.1, 0.3, 0.6]), np.array([100, 100, 1]), 50
  draws = np.array([buckets.capped_multinomial(n, probs, sizes, rng) for _ in range(1500)])
  assert (draws.sum(axis=1) == n).all() and (draws <= sizes).all()
  assert (draws[:, 2] == 1).all()
  # Surplus of bucket 2 is X - 1 with X ~ Bin(50, 0.6); it goes 1:3 to buckets 0 and 1.
  surplus = n * 0.6 - 1 + 0.4 ** n
  expected = np.array([n * 0.1 + surplus * 0.25, n * 0.3 + surplus * 0.75])
  se = draws[:, :2].std(axis=0) / np.sqrt(len(draws))
  assert (np.abs(draws[:, :2].mean(axis=0) - expected) < 4 * se).all()


def test_sampling_with_capping_returns_distinct_candidates():
  buf = _filled_buffer({3: 2, 4: 3, 5: 40})
  for _ in range(50):
    qids = buf.sample_questions(20)
    assert len(qids) == 20 and len(set(qids.tolist())) == 20
    assert {0, 1, 2, 3, 4} <= set(qids.tolist())  # buckets 3 and 4 hold 5 in all, p ~ 0.9
  assert sorted(buf.sample_questions(1000).tolist()) == list(range(45))
  assert len(replay.ExperienceBuffer(dict(k=K)).sample_questions(4)) == 0


def test_update_rules_retire_bucket_dedup_and_collect():
  rng = np.random.default_rng(1)
  buf = replay.ExperienceBuffer(dict(k=K, vocab_size=V), seed=0)
  r3, g3 = _group(rng, 3)
  r8, g8 = _group(rng, 8)
  r0, g0 = _group(rng, 0)
  # Before the delayed start: 8/8 retires, nothing is stored.
  out = buf.update([10, 11], np.stack([r3, r8]), [g3, g8], step=1, collect=False)
  assert out["retired"] == 1 and out["stored"] == 0
  assert buf.retired == {11} and buf.num_candidates == 0
  # After it: 3/8 stores the 3 correct responses, exactly, with their step.
  out = buf.update([10], r3[None], [g3], step=2)
  assert out == dict(retired=0, stored=3, duplicates=0, evicted=0)
  assert buf.bucket(10) == 3
  stored = buf.candidates(10)
  correct = [g3[j] for j in np.flatnonzero(r3)]
  for s, (ids, logp) in zip(stored, correct):
    np.testing.assert_array_equal(s.token_ids, ids)
    np.testing.assert_allclose(s.logps, logp, atol=2.0 ** -11)
    assert s.token_ids.dtype == np.int32 and s.step == 2
  # 0/8 leaves the entry as it was.
  buf.update([10], r0[None], [g0], step=3)
  assert buf.bucket(10) == 3 and len(buf.candidates(10)) == 3
  # The same correct responses again are duplicates; the bucket follows the latest count.
  r5 = r3.copy()
  r5[np.flatnonzero(r3 == 0)[:2]] = 1
  out = buf.update([10], r5[None], [g3], step=4)
  assert out["stored"] == 2 and out["duplicates"] == 3 and buf.bucket(10) == 5
  # A question twice in one batch: the last group's bucket, both groups' responses.
  r2, g2 = _group(rng, 2)
  r6, g6 = _group(rng, 6)
  buf.update([20, 20], np.stack([r6, r2]), [g6, g2], step=5)
  assert buf.bucket(20) == 2 and len(buf.candidates(20)) == 8
  # Retirement is permanent: later partial groups never bring the question back.
  buf.update([10], r8[None], [g8], step=6)
  buf.update([10], r3[None], [g3], step=7)
  assert 10 in buf.retired and 10 not in buf.sample_questions(100)
  with pytest.raises(KeyError, match="retired"):
    buf.candidates(10)
  assert buf.stats()["trajectories"] == 8 and buf.stats()["retired"] == 2


def test_update_rejects_bad_input():
  rng = np.random.default_rng(2)
  buf = replay.ExperienceBuffer(dict(k=K, vocab_size=1000))
  r, g = _group(rng, 4)
  with pytest.raises(ValueError, match=r"rewards_QxK has shape \(1, 7\)"):
    buf.update([1], r[None, :7], [g], step=0)
  g_bad = [(np.array([5, 1000]), np.zeros(2, np.float32))] * K
  with pytest.raises(ValueError, match="question 1: token id 1000 is outside"):
    buf.update([1], np.ones((1, K)) * (np.arange(K) < 3), [g_bad], step=0)
  g_bad = [(np.array([5, 6]), np.zeros(3, np.float32))] * K
  with pytest.raises(ValueError, match="question 2 item 0"):
    buf.update([2], np.ones((1, K)) * (np.arange(K) < 3), [g_bad], step=0)
  with pytest.raises(TypeError, match="question ids must be integers"):
    buf.update(["q"], r[None], [g], step=0)
  with pytest.raises(ValueError, match="weighting"):
    replay.ExperienceBuffer(dict(weighting="gauss"))


class _ReferenceBuffer:
  """The docs/algorithm.md §10 rules over plain lists, to check the real buffer against."""

  def __init__(self, max_per_question, max_total):
    self.caps = max_per_question, max_total
    self.trajs = {}  # qid -> [(ids tuple, step, seq)]
    self.bucket, self.retired, self.seq = {}, set(), 0

  def update(self, qids, rewards, groups, step):
    for q, r in zip(qids, rewards):
      if r.sum() == K:
        self.retired.add(q)
        self.trajs.pop(q, None)
        self.bucket.pop(q, None)
    for q, r, g in zip(qids, rewards, groups):
      if q in self.retired or not 0 < r.sum() < K:
        continue
      self.bucket[q] = int(r.sum())
      have = self.trajs.setdefault(q, [])
      for j in np.flatnonzero(r):
        key = tuple(g[j][0].tolist())
        if all(key != t[0] for t in have):
          have.append((key, step, self.seq))
          self.seq += 1
    for have in self.trajs.values():
      if self.caps[0]:
        del have[:-self.caps[0]]
    while self.caps[1] and sum(map(len, self.trajs.values())) > self.caps[1]:
      q = min(self.trajs, key=lambda q: self.trajs[q][0][2])
      self.trajs[q].pop(0)
      if not self.trajs[q]:
        del self.trajs[q], self.bucket[q]


@pytest.mark.parametrize("caps", [(0, 0), (3, 0), (0, 60), (2, 40)])
def test_buffer_matches_reference_model_with_caps_and_compaction(caps):
  rng = np.random.default_rng(sum(caps))
  buf = replay.ExperienceBuffer(dict(k=K, vocab_size=V, max_per_question=caps[0],
                                     max_total=caps[1]), seed=0)
  ref = _ReferenceBuffer(*caps)
  pool = [_traj(rng) for _ in range(12)]  # a small pool makes duplicates common
  for step in range(40):
    qids = rng.integers(0, 25, 6).tolist()
    rewards = (rng.random((6, K)) < rng.random((6, 1)) * 1.3).astype(float)
    groups = [[pool[i] for i in rng.integers(0, len(pool), K)] for _ in qids]
    buf.update(qids, rewards, groups, step)
    ref.update(qids, rewards, groups, step)
    assert buf.retired == ref.retired
    assert {q: buf.bucket(q) for q in ref.bucket} == ref.bucket
    assert buf.num_candidates == len(ref.bucket)
    for q, expected in ref.trajs.items():
      got = buf.candidates(q)
      assert [tuple(t.token_ids.tolist()) for t in got] == [e[0] for e in expected]
      assert [t.step for t in got] == [e[1] for e in expected]
    s = buf.stats()
    assert s["trajectories"] == sum(map(len, ref.trajs.values()))
    assert sum(s[f"bucket/{b}"] for b in range(1, K)) == len(ref.bucket)
  assert buf.stats()["retired"] > 0


def test_state_dict_round_trip_gives_identical_future():
  rng = np.random.default_rng(3)
  buf = _filled_buffer({2: 5, 4: 7, 6: 3}, seed=3, max_per_question=4, max_total=60)
  buf.update([1], np.ones((1, K)), [[_traj(rng) for _ in range(K)]], step=1)
  buf.sample_questions(4)
  saved = io.BytesIO()
  np.savez(saved, **buf.state_dict())
  saved.seek(0)
  restored = replay.ExperienceBuffer.from_state_dict(dict(np.load(saved)))
  for step in range(2, 8):
    groups = [_group(rng, int(rng.integers(0, K + 1))) for _ in range(4)]
    args = ([3, 40 + step, 5, 11], np.stack([g[0] for g in groups]), [g[1] for g in groups])
    assert buf.update(*args, step=step) == restored.update(*args, step=step)
    a, b = buf.sample_questions(6), restored.sample_questions(6)
    np.testing.assert_array_equal(a, b)
    for q in a:
      for x, y in zip(buf.candidates(q), restored.candidates(q)):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        np.testing.assert_array_equal(x.logps, y.logps)
        assert x.step == y.step
  assert buf.retired == restored.retired and 1 in buf.retired
  a, b = buf.stats(), restored.stats()
  assert a.pop("allocated_bytes") and b.pop("allocated_bytes") and a == b
  with pytest.raises(ValueError, match="k=8"):
    replay.ExperienceBuffer.from_state_dict(buf.state_dict(), dict(k=4, vocab_size=V))


def test_storage_codec_precision_and_width():
  logp = np.concatenate([np.linspace(storage.LOGP_MIN, 0, 100001),
                         [1e-7, -70.0, -np.inf]]).astype(np.float32)
  codes, clamped = storage.encode_logps(logp)
  assert clamped == 2 and codes[-3] == 0 and codes[-1] == np.iinfo(np.uint16).max
  decoded = storage.decode_logps(codes)[:-3].astype(np.float64)
  ratio_err = np.abs(np.expm1(decoded - logp[:-3]))
  assert ratio_err.max() <= np.expm1(2.0 ** -11)
  narrow = storage.TrajectoryStore(vocab_size=49152)
  wide = storage.TrajectoryStore(vocab_size=V)
  ids = np.array([0, 1, 65535, 65536, V - 1])
  wide.add([7], [ids], [np.zeros(5, np.float32)], step=3)
  np.testing.assert_array_equal(wide.trajectories(7)[0].token_ids, ids)
  assert narrow.bytes_per_token() == 4 and wide.bytes_per_token() == 5


def test_selection_by_mean_entropy():
  rng = np.random.default_rng(4)
  entropy = rng.random((5, 9))
  mask = rng.random((5, 9)) < 0.6
  mask[:, 0] = True
  entropy[1] = np.where(mask[1], 0.01, 100.0)  # lowest mean, though padding is huge
  entropy[3] = np.where(mask[3], 5.0, -100.0)  # highest mean
  means = [entropy[i][mask[i]].mean() for i in range(5)]
  np.testing.assert_allclose(selection.mean_entropy(entropy, mask), means)
  assert selection.SELECTIONS.get("lowest_entropy")(entropy, mask) == 1
  assert selection.SELECTIONS.get("highest_entropy")(entropy, mask) == 3
  picks = [selection.SELECTIONS.get("random")(entropy, mask, np.random.default_rng(s))
           for s in range(300)]
  assert set(picks) == set(range(5))
  with pytest.raises(ValueError, match="needs a np.random.Generator"):
    selection.random(entropy, mask)
  mask[2] = False
  with pytest.raises(ValueError, match=r"candidates \[2\] have no valid tokens"):
    selection.lowest_entropy(entropy, mask)


def test_std_buckets_for_continuous_rewards():
  """round(K s~) of the batch-normalised reward std, clipped into the stored buckets
  1..K-1; a question with equal rewards (std 0) gets 0."""
  rewards = np.array([[0.5] * 4, [0.0, 1.0, 0.0, 1.0], [0.2, 0.4, 0.2, 0.4], [1.0] * 4,
                      [0.2, 0.2, 0.2, 0.3], [0.0, 1.0, 1.0, 1.0]])
  std = rewards.std(axis=1)
  scaled = (std - std.min()) / (std.max() - std.min())
  assert std.argmax() == 1 and np.rint(4 * scaled[1]) == 4  # the paper's level K
  assert np.rint(4 * scaled[4]) == 0 and np.rint(4 * scaled[5]) == 3  # and level 0
  assert buckets.std_buckets(rewards).tolist() == [0, 3, 1, 0, 1, 3]
  assert buckets.std_buckets(np.ones((3, 4))).tolist() == [0, 0, 0]
  # Every std equal and non-zero (min-max undefined): all in bucket 1.
  assert buckets.std_buckets(np.tile([0.0, 1.0, 0.0, 1.0], (3, 1))).tolist() == [1, 1, 1]


def test_reward_std_buckets_store_the_highest_variance_question():
  """In the buffer: every question with unequal rewards and a response at or above
  correct_threshold is stored, the batch's highest-variance one (question 1) and its
  lowest non-zero one (question 4) included; 4 of 4 at or above the threshold retires."""
  rewards = np.array([[0.5] * 4, [0.0, 1.0, 0.0, 1.0], [0.2, 0.4, 0.2, 0.4], [1.0] * 4,
                      [0.2, 0.2, 0.2, 0.3], [0.0, 1.0, 1.0, 1.0]])
  rng = np.random.default_rng(5)
  buf = replay.ExperienceBuffer(dict(k=4, correct_threshold=0.3))
  groups = [[_traj(rng) for _ in range(4)] for _ in range(6)]
  summary = buf.update(range(6), rewards, groups, step=0,
                       buckets_Q=buckets.std_buckets(rewards))
  assert buf.retired == {0, 3}  # every reward >= 0.3
  assert buf.question_ids == [1, 2, 4, 5]
  assert [buf.bucket(q) for q in (1, 2, 4, 5)] == [3, 1, 1, 3]
  assert [len(buf.candidates(q)) for q in (1, 2, 4, 5)] == [2, 2, 1, 3]
  assert summary["stored"] == 8
  with pytest.raises(ValueError, match="buckets_Q is float64"):
    buf.update([0], rewards[:1], groups[:1], step=1, buckets_Q=np.array([1.5]))
