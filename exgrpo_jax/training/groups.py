"""Host-side records of a training step: one response, and one question's group.

A group carries its question's rendered prompt, its K responses (a replay group's
replayed trajectory last), and, once graded, their rewards and advantages. The phases
of `Trainer.train_step` pass lists of groups along; nothing looks a question up by id.
"""

import dataclasses

import numpy as np

from exgrpo_jax import data


@dataclasses.dataclass
class Response:
  """One member of a group.

  `old_logp` is what the loss compares the current log-probs with, per token, at
  temperature 1: pi_old for a fresh response (the rollout's or the learner's recompute,
  `algo.old_logp_source`), which is also what the buffer stores as its behaviour
  log-probs; for the replayed member, the behaviour log-probs recorded at collection
  (or, in the no-IS ablation, the current policy's).

  `rollout_log_ratio` is, for a fresh response whose pi_old was recomputed, log pi_old -
  log pi_rollout per token, both at the rollout temperature (the rollout/learner
  mismatch; docs/algorithm.md §19); None otherwise.
  """

  tokens: np.ndarray          # int32 [L], EOS included
  old_logp: np.ndarray        # float32 [L]
  text: str
  is_replay: bool = False
  truncated: bool = False
  rollout_log_ratio: np.ndarray | None = None  # float32 [L]


@dataclasses.dataclass
class Group:
  """A question's K responses; `rewards` and `advantages` [K] are set by grading.

  `replay_candidates`: for a replay group, how many stored trajectories its replayed
  member was chosen from.
  """

  prompt: data.Prompt
  responses: list[Response]
  rewards: np.ndarray | None = None
  advantages: np.ndarray | None = None
  replay_candidates: int = 0

  @property
  def question_id(self) -> int:
    return self.prompt.question.uid

  @property
  def prompt_ids(self) -> list[int]:
    return list(self.prompt.ids)

  @property
  def is_replay(self) -> bool:
    return any(r.is_replay for r in self.responses)


def responses(groups: list[Group]) -> list[Response]:
  """Every response of `groups`, group-major (the order of rewards_N)."""
  return [r for g in groups for r in g.responses]


def rewards_QxK(groups: list[Group]) -> np.ndarray:
  return np.stack([g.rewards for g in groups])
