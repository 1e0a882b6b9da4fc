"""The run's two phases and the switches that follow them (docs/algorithm.md §3, §11, §13).

Before the delayed start every question is fresh, fresh tokens take the clipped ratio
and the buffer only retires solved questions; once a step's batch accuracy exceeds
`algo.delayed_start` (strictly), replay is on for good: n_exp questions per step come
from the buffer and fresh tokens lose their clip (unless `algo.clip_after_delayed_start`).
Also here: where pi_old and the stored behaviour log-probs come from
(`algo.old_logp_source`, and `algo.tis_cap`, which needs them recomputed), and the
temperature the rollout's log-probs are at.
"""

import numpy as np

OLD_LOGP_SOURCES = ("auto", "rollout", "recompute")


def replay_started(started: bool, accuracy: float, threshold: float) -> bool:
  """Step 9: the flag after a step with batch accuracy `accuracy` (mean reward)."""
  return started or accuracy > threshold


def keeps_buffer(algo) -> bool:
  """Whether a run keeps the experience buffer (step 7): every run but the on-policy
  baseline (rho = 0 with the `grpo` loss). ExGRPO at rho = 0 still retires questions
  solved K/K and stores partially solved ones it never replays (the `noreplay` variant:
  experience management and the mixed phase's unclipped fresh tokens without replay)."""
  return algo.rho > 0 or algo.loss != "grpo"


def num_replayed(started: bool, rho: float, batch_questions: int,
                 num_candidates: int) -> int:
  """Step 1: n_exp = min(floor(rho B), |candidates|) after the start, else 0."""
  if not started:
    return 0
  return min(int(np.floor(rho * batch_questions)), num_candidates)


def use_clip(started: bool, clip_after_delayed_start: bool) -> bool:
  """Step 8: fresh tokens are clipped before the start (after it, only if asked)."""
  return not started or clip_after_delayed_start


def recompute_old_logps(config) -> bool:
  """Whether the learner recomputes pi_old (and the behaviour log-probs the buffer stores).

  `auto` recomputes whenever the rollout's numbers are not the learner's: another
  dtype than float32 (the sampler's decode steps and the learner's full forward round
  differently), an engine other than the JAX sampler (vLLM), or a temperature other
  than 1 (the sampler reports log-probs of the temperature-scaled distribution); and
  whenever truncated importance sampling is on (`algo.tis_cap`), which weighs the
  rollout's log-probs against the learner's (`rollout` is then refused by config_check).
  """
  source = config.algo.old_logp_source
  if source != "auto":
    return source == "recompute"
  return (config.model.dtype != "float32" or config.rollout.engine != "jax"
          or config.rollout.temperature != 1.0 or bool(config.algo.tis_cap))


def rollout_logp_temperature(rollout) -> float | None:
  """The temperature of the rollout's log-probs (`rollout` section), at which the
  learner also scores the rollouts (besides 1), or None where that is 1: the sampling
  temperature, and 1 for greedy rollouts (T = 0), which both engines report at T = 1."""
  temperature = rollout.temperature if rollout.temperature > 0 else 1.0
  return None if temperature == 1 else temperature
