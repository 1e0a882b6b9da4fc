"""The fresh-question stream: shuffled epochs, put-back, retirement, resumable state.

  stream = QuestionStream(questions, seed=0)
  batch = stream.next_batch(64)        # Question records
  stream.put_back([q.uid for q in batch[48:]])  # unused this step: served first next time
  stream.retire([uid, ...])            # solved K/K: never served again
  state = stream.state_dict()          # a small JSON-friendly dict for the checkpoint

Epoch e visits the active questions in the order of a permutation drawn from
numpy's PCG64 seeded with (seed, e), so the order is a pure function of (seed, epoch)
and the state needs no RNG internals. A batch never holds a question twice: when an
epoch ends mid-batch, questions of the new epoch that are already in the batch wait
for the next batch (they go to the front of the put-back queue).
"""

from typing import Sequence

import numpy as np

from exgrpo_jax.data import questions as questions_lib


class QuestionStream:
  """Deterministic, resumable order over questions keyed by `uid`."""

  def __init__(self, questions: Sequence[questions_lib.Question], seed: int = 0):
    self._by_uid = {q.uid: q for q in questions}
    if len(self._by_uid) != len(questions):
      raise ValueError("QuestionStream: question uids are not unique")
    self._uids = np.array(sorted(self._by_uid), np.int64)
    self.seed = int(seed)
    self.epoch = 0
    self.position = 0
    self._returned: list[int] = []
    self._retired: set[int] = set()
    self._order = self._epoch_order(0)

  def _epoch_order(self, epoch: int) -> np.ndarray:
    rng = np.random.default_rng([self.seed, epoch])
    return self._uids[rng.permutation(len(self._uids))]

  @property
  def num_active(self) -> int:
    """Questions not retired."""
    return len(self._uids) - len(self._retired)

  def next_batch(self, n: int) -> list[questions_lib.Question]:
    """The next `n` distinct active questions (fewer only if fewer than n are active)."""
    n = min(n, self.num_active)
    batch, seen, deferred = [], set(), []
    returned, self._returned = self._returned, []
    for uid in returned:
      if uid in self._retired or uid in seen or uid in deferred:
        continue
      if len(batch) < n:
        batch.append(uid)
        seen.add(uid)
      else:
        deferred.append(uid)
    while len(batch) < n:
      if self.position == len(self._order):
        self.epoch += 1
        self.position = 0
        self._order = self._epoch_order(self.epoch)
      uid = int(self._order[self.position])
      self.position += 1
      if uid in self._retired:
        continue
      if uid in seen:
        deferred.append(uid)
      else:
        batch.append(uid)
        seen.add(uid)
    self._returned = deferred
    return [self._by_uid[u] for u in batch]

  def put_back(self, uids: Sequence[int]) -> None:
    """Returns unused questions; they are served first, in the order given."""
    self._check(uids)
    self._returned = [int(u) for u in uids] + self._returned

  def retire(self, uids: Sequence[int]) -> None:
    """Removes questions from the stream for good."""
    self._check(uids)
    self._retired.update(int(u) for u in uids)

  def _check(self, uids) -> None:
    unknown = [int(u) for u in uids if int(u) not in self._by_uid]
    if unknown:
      raise KeyError(f"QuestionStream: unknown question uids {unknown[:5]}")

  def state_dict(self) -> dict:
    """Everything needed to continue exactly: plain ints and lists (JSON-friendly)."""
    return dict(seed=self.seed, epoch=self.epoch, position=self.position,
                returned=list(self._returned), retired=sorted(self._retired))

  def load_state_dict(self, state: dict) -> None:
    """Restores a `state_dict()` taken from a stream over the same questions."""
    missing = {"seed", "epoch", "position", "returned", "retired"} - set(state)
    if missing:
      raise KeyError(f"QuestionStream state lacks {sorted(missing)}")
    self._check(state["returned"])
    self._check(state["retired"])
    if not 0 <= state["position"] <= len(self._uids):
      raise ValueError(f"QuestionStream state position {state['position']} is outside "
                       f"[0, {len(self._uids)}] (a different question set?)")
    self.seed = int(state["seed"])
    self.epoch = int(state["epoch"])
    self.position = int(state["position"])
    self._returned = [int(u) for u in state["returned"]]
    self._retired = {int(u) for u in state["retired"]}
    self._order = self._epoch_order(self.epoch)
