"""Evaluation metrics: unbiased pass@k, avg@k over repeated rows, per-source summaries.

A benchmark question may appear as several identical rows (the ExGRPO test set repeats
each AIME problem 32 times) and each row may be sampled `n` times; all samples of one
question form its group. With c correct out of m samples:

  avg@m  = mean over questions of c / m (the paper's "Avg@32"; with m = 1 it is pass@1)
  pass@k = mean over questions of 1 - C(m - c, k) / C(m, k)   (Chen et al. 2021)
"""

import numpy as np

from exgrpo_jax.rewards import graders


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
  """Unbiased pass@k of one question: 1 - C(n - c, k) / C(n, k)."""
  n, c = num_samples, num_correct
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i), stable for large n.
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def k_values(num_samples: int) -> list[int]:
  """1, 2, 4, ... up to num_samples, and num_samples itself."""
  ks = [1 << i for i in range(num_samples.bit_length()) if 1 << i <= num_samples]
  return ks + ([num_samples] if ks[-1] != num_samples else [])


def summarize(group_G: np.ndarray, correct_G: np.ndarray, length_G: np.ndarray,
              truncated_G: np.ndarray, status_G: np.ndarray) -> dict:
  """Metrics of one data_source from its per-sample arrays.

  Args:
    group_G: question id of each sample (equal ids = repeated rows of one question).
    correct_G: reward > 0 of each sample.
    length_G: response length in tokens.
    truncated_G: whether the response hit the token limit.
    status_G: grading status (`graders.STATUSES`); the fraction of each is reported, and
      the number of exceptions.
  """
  _, group_G = np.unique(group_G, return_inverse=True)
  samples_Q = np.bincount(group_G)
  correct_Q = np.bincount(group_G, weights=correct_G.astype(np.float64)).astype(np.int64)
  k = int(samples_Q.min())
  out = {
      "questions": int(samples_Q.size),
      "samples": int(group_G.size),
      "k": k,  # samples per question (the smallest, if they differ)
      "avg@k": float(np.mean(correct_Q / samples_Q)),
      "pass@k": {str(j): float(np.mean([pass_at_k(int(s), int(c), j)
                                        for s, c in zip(samples_Q, correct_Q)]))
                 for j in k_values(k)},
      "mean_response_length": float(np.mean(length_G)),
      "truncated_frac": float(np.mean(truncated_G)),
  }
  for status in graders.STATUSES:
    out[f"{status}_frac"] = float(np.mean(status_G == status))
  out["exceptions"] = int(np.sum(status_G == graders.EXCEPTION))
  return out

