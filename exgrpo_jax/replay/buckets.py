"""Question buckets and bucket sampling (docs/algorithm.md §4 and §10): pure functions.

A buffered question sits in bucket k = its latest number of correct rollouts out of K
(1..K-1), or with `replay.bucketing = reward_std` its reward-std level (`std_buckets`,
also 1..K-1). Arrays indexed by bucket have length K+1 (buckets 0 and K stay empty).
"""

import numpy as np

WEIGHTINGS = ("gaussian", "uniform", "proportional")
# correct_count: bucket = correct responses out of K; reward_std: `std_buckets`.
BUCKETINGS = ("correct_count", "reward_std")


def bucket_probs(sizes_B: np.ndarray, *, mu: float, sigma: float,
                 weighting: str = "gaussian") -> np.ndarray:
  """Probability of drawing from each bucket, zero on empty ones.

  Args:
    sizes_B: candidate questions per bucket, length K+1 (index = correct count).
    mu, sigma: Gaussian centre and width in accuracy units (k/K).
    weighting: "gaussian" (ExGRPO: weight exp(-(k - mu K)^2 / (2 (sigma K)^2))),
      "uniform" (every non-empty bucket alike; the no_qsel ablation, docs/algorithm.md §17)
      or "proportional" (weight = bucket size, i.e. uniform over questions).
  """
  sizes_B = np.asarray(sizes_B)
  k = len(sizes_B) - 1
  nonempty = sizes_B > 0
  if not nonempty.any():
    raise ValueError("replay: no non-empty bucket to sample from")
  if weighting == "gaussian":
    if not sigma > 0:
      raise ValueError(f"replay sigma must be > 0, got {sigma}")
    # In log space, shifted by the best non-empty bucket, so a narrow Gaussian far from
    # every non-empty bucket still gives a distribution instead of 0/0.
    logw = -((np.arange(k + 1) - mu * k) ** 2) / (2 * (sigma * k) ** 2)
    logw = np.where(nonempty, logw, -np.inf)
    weights = np.exp(logw - logw.max())
  elif weighting == "uniform":
    weights = nonempty.astype(np.float64)
  elif weighting == "proportional":
    weights = sizes_B.astype(np.float64)
  else:
    raise ValueError(f"replay weighting must be one of {WEIGHTINGS}, got {weighting!r}")
  return weights / weights.sum()


def capped_multinomial(n: int, probs_B: np.ndarray, sizes_B: np.ndarray,
                       rng: np.random.Generator) -> np.ndarray:
  """Multinomial bucket counts, each capped at its bucket size.

  Draws over the cap are handed, one at a time, to buckets that still have room, with
  probability proportional to `probs_B` among them (the reference's rule).
  """
  sizes_B = np.asarray(sizes_B)
  if n > sizes_B.sum():
    raise ValueError(f"replay: cannot draw {n} questions from {sizes_B.sum()} candidates")
  counts = rng.multinomial(n, probs_B)
  surplus = int(np.maximum(counts - sizes_B, 0).sum())
  counts = np.minimum(counts, sizes_B)
  for _ in range(surplus):
    room = counts < sizes_B
    p = np.where(room, probs_B, 0.0)
    p = p / p.sum() if p.sum() > 0 else room / room.sum()
    counts[rng.choice(len(p), p=p)] += 1
  return counts


def std_buckets(rewards_QxK: np.ndarray, eps: float = 1e-6) -> np.ndarray:
  """Buckets for continuous rewards (`replay.bucketing = reward_std`), in 0..K-1.

  The paper's level round(K s~) of the per-question reward std s, min-max normalised
  over the batch (s~ = (s - s_min) / max(s_max - s_min, eps)), clipped into the buckets
  the buffer stores, 1..K-1. Unclipped, round(K s~) runs over 0..K, and 0 and K are the
  levels the buffer leaves alone (0/K and K/K under the correct-count rule): every batch
  would lose its highest-variance question (s~ = 1) and its lowest (s~ = 0) for good.
  A question whose K rewards are all equal (std 0: zero advantages, nothing to learn
  from its trajectories) gets 0 and is not stored. A batch whose stds are all equal
  and non-zero goes to bucket 1.
  """
  rewards_QxK = np.asarray(rewards_QxK, np.float64)
  if rewards_QxK.ndim != 2:
    raise ValueError(f"rewards must be [Q, K], got shape {rewards_QxK.shape}")
  k = rewards_QxK.shape[1]
  std_Q = rewards_QxK.std(axis=1)
  scaled = (std_Q - std_Q.min()) / max(std_Q.max() - std_Q.min(), eps)
  levels = np.clip(np.rint(scaled * k), 1, k - 1).astype(np.int64)
  return np.where(std_Q > 0, levels, 0)
