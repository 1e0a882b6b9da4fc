"""Which stored trajectory of a sampled question to replay (docs/algorithm.md §5).

Pure functions over per-token entropies of a question's N candidates under the current
policy (full-vocabulary entropy at temperature 1, from `logprobs.sequence_logprobs`):

  pick = selection.SELECTIONS.get(config.algo.trajectory_selection)(entropy_NxT, mask_NxT,
                                                                  rng)

The score is the mean over each candidate's valid tokens (EOS included), the metric the
reference code intended; its mask bug made it closer to the lowest total entropy.
"""

import numpy as np

from exgrpo_jax import registry

SELECTIONS = registry.Registry("trajectory selection")


def mean_entropy(entropy_NxT: np.ndarray, mask_NxT: np.ndarray) -> np.ndarray:
  """Mean entropy over each candidate's valid tokens, [N] float64."""
  entropy_NxT = np.asarray(entropy_NxT, np.float64)
  mask_NxT = np.asarray(mask_NxT, bool)
  if entropy_NxT.ndim != 2 or entropy_NxT.shape != mask_NxT.shape or not len(entropy_NxT):
    raise ValueError(f"selection: entropy {entropy_NxT.shape} and mask {mask_NxT.shape} "
                     "must be equal [N, T] shapes with N >= 1")
  counts_N = mask_NxT.sum(axis=1)
  if (counts_N == 0).any():
    raise ValueError(f"selection: candidates {np.flatnonzero(counts_N == 0).tolist()} "
                     "have no valid tokens")
  return np.where(mask_NxT, entropy_NxT, 0.0).sum(axis=1) / counts_N


@SELECTIONS.register("lowest_entropy")
def lowest_entropy(entropy_NxT, mask_NxT, rng=None) -> int:
  """The candidate with the lowest mean token entropy (first one on ties). ExGRPO default."""
  del rng
  return int(np.argmin(mean_entropy(entropy_NxT, mask_NxT)))


@SELECTIONS.register("highest_entropy")
def highest_entropy(entropy_NxT, mask_NxT, rng=None) -> int:
  """The candidate with the highest mean token entropy (an ablation)."""
  del rng
  return int(np.argmax(mean_entropy(entropy_NxT, mask_NxT)))


@SELECTIONS.register("random")
def random(entropy_NxT, mask_NxT, rng: np.random.Generator | None = None) -> int:
  """A uniformly random candidate (the "no trajectory selection" ablation)."""
  if rng is None:
    raise ValueError("selection 'random' needs a np.random.Generator (e.g. buffer.rng)")
  return int(rng.integers(len(mean_entropy(entropy_NxT, mask_NxT))))
