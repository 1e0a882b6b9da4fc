"""Group-relative advantages (docs/algorithm.md §9), registered by name.

A group is one question's K responses; in a replay group the replayed trajectory is one
member and shares the group statistics with the K-1 fresh ones. Rewards are [Q, K].

  adv_QxK = advantages.ADVANTAGES.get(config.algo.advantage)(rewards_QxK)
"""

import jax.numpy as jnp

from exgrpo_jax import registry

ADVANTAGES = registry.Registry("advantage estimator")


def _check(rewards_QxK):
  rewards_QxK = jnp.asarray(rewards_QxK)
  if rewards_QxK.ndim != 2:
    raise ValueError(f"rewards must be [Q, K] (one row per group), got {rewards_QxK.shape}")
  return rewards_QxK.astype(jnp.promote_types(rewards_QxK.dtype, jnp.float32))


@ADVANTAGES.register("group_mean")
def group_mean(rewards_QxK):
  """A = r - mean(group) (Dr.GRPO, the ExGRPO default). A group of one keeps A = r."""
  rewards_QxK = _check(rewards_QxK)
  if rewards_QxK.shape[1] == 1:
    return rewards_QxK
  return rewards_QxK - rewards_QxK.mean(axis=1, keepdims=True)


@ADVANTAGES.register("group_std")
def group_std(rewards_QxK, eps: float = 1e-6):
  """A = (r - mean) / (std + eps), unbiased std as `torch.std`. A group of one: A = r."""
  rewards_QxK = _check(rewards_QxK)
  if rewards_QxK.shape[1] == 1:
    return rewards_QxK
  std_Qx1 = rewards_QxK.std(axis=1, ddof=1, keepdims=True)
  return (rewards_QxK - rewards_QxK.mean(axis=1, keepdims=True)) / (std_Qx1 + eps)
