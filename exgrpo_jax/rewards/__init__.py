"""Verifiable rewards: graders by name (Math-Verify, multiple choice, GSM8K,
reasoning_gym's verifiers) and the worker pool that runs them under a per-item deadline."""

from exgrpo_jax.rewards.graders import (REWARDS, SOURCE_REWARDS, STATUSES, ends_with_think,
                                        grade, load_plugins, reward_for_source)
from exgrpo_jax.rewards.pool import RewardItem, RewardPool
