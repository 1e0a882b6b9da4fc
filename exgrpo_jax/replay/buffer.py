"""The ExGRPO experience buffer: buckets, retirement, Gaussian question sampling, checkpoints.

Host-side NumPy with one seeded `np.random.Generator`; docs/algorithm.md §4 and §10.

  buf = ExperienceBuffer(config.replay, seed=0)
  buf.update(qids, rewards_QxK, trajectories, step, collect=replay_started)
  qids = buf.sample_questions(n_exp)
  options = buf.candidates(qids[0])      # stored trajectories, for entropy selection
"""

import dataclasses
import json
from typing import Any, Mapping, Sequence

import numpy as np

from exgrpo_jax.replay import buckets
from exgrpo_jax.replay import storage

_STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class BufferConfig:
  """Keys read from the config's `replay` section (other keys there are ignored).

  k: rollouts per question K. mu, sigma: bucket Gaussian in accuracy units (sigma None
  means 1/K, the official code's one-success width; docs/algorithm.md §4). weighting: see
  `buckets.bucket_probs`. max_per_question, max_total: trajectory caps, 0 = none (oldest
  evicted first). vocab_size: largest token id + 1 (None: up to 2^24, 5 bytes/token).
  correct_threshold: a response is correct when its reward is at least this.
  """

  k: int = 8
  mu: float = 0.5
  sigma: float | None = None
  weighting: str = "gaussian"
  max_per_question: int = 0
  max_total: int = 0
  vocab_size: int | None = None
  correct_threshold: float = 1.0

  def __post_init__(self):
    if self.k < 2:
      raise ValueError(f"replay k must be >= 2, got {self.k}")
    if self.weighting not in buckets.WEIGHTINGS:
      raise ValueError(f"replay weighting must be one of {buckets.WEIGHTINGS}, "
                       f"got {self.weighting!r}")
    if self.sigma is not None and not self.sigma > 0:
      raise ValueError(f"replay sigma must be > 0 (None = 1/K), got {self.sigma}")
    for name in ("max_per_question", "max_total"):
      if getattr(self, name) < 0:
        raise ValueError(f"replay {name} must be >= 0 (0 = no cap), got {getattr(self, name)}")

  @property
  def sigma_acc(self) -> float:
    return 1.0 / self.k if self.sigma is None else self.sigma

  @classmethod
  def from_mapping(cls, config: Mapping[str, Any] | None) -> "BufferConfig":
    """From a dict or ConfigDict; missing keys take the defaults above."""
    if isinstance(config, cls):
      return config
    config = config or {}
    return cls(**{f.name: config.get(f.name, f.default) for f in dataclasses.fields(cls)})


class ExperienceBuffer:
  """Correct trajectories of partially solved questions, bucketed by latest accuracy."""

  def __init__(self, config: Mapping[str, Any] | BufferConfig | None = None, seed: int = 0):
    self.config = BufferConfig.from_mapping(config)
    self._rng = np.random.default_rng(seed)
    self._store = storage.TrajectoryStore(self.config.vocab_size)
    self._members: list[list[int]] = [[] for _ in range(self.config.k + 1)]
    self._bucket: dict[int, int] = {}  # question -> bucket, for candidate questions only
    self._slot: dict[int, int] = {}  # question -> index in self._members[bucket]
    self._retired: set[int] = set()
    self._evicted = 0

  # --- updates, docs/algorithm.md §10 ------------------------------------------------------

  def update(self, question_ids: Sequence[int], rewards_QxK: np.ndarray,
             trajectories: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]], step: int,
             collect: bool = True, buckets_Q: np.ndarray | None = None) -> dict[str, int]:
    """Applies one training step's groups to the buffer.

    A K/K group retires its question for good (always, also with collect=False). With
    collect, a group with 1..K-1 correct sets its question's bucket to that count and
    stores every correct response, deduplicated by token ids; a 0/K group leaves the
    entry alone. Retired questions are never stored again. A question in two groups of
    one batch gets the last group's bucket and the correct responses of both. Caps are
    applied after all of the batch's additions, oldest trajectories evicted first.

    Args:
      question_ids: [Q] dataset ids of the groups' questions.
      rewards_QxK: [Q, K] rewards (a replay group's replayed member included).
      trajectories: [Q][K] (token_ids, behaviour_logps) pairs: the response tokens (EOS
        included) and the per-token log-probs recorded at this step. Only correct ones
        are read.
      step: training step, stored with each trajectory.
      collect: False before the delayed start (retirement only).
      buckets_Q: optional [Q] buckets overriding the correct count (the continuous-
        reward variant, `buckets.std_buckets`); 0 and K mean "leave the entry".

    Returns:
      counts for logging: retired (newly), stored, duplicates, evicted.
    """
    k = self.config.k
    qids = [_as_question_id(q) for q in question_ids]
    rewards_QxK = np.asarray(rewards_QxK, np.float64)
    if rewards_QxK.shape != (len(qids), k):
      raise ValueError(f"replay update: rewards_QxK has shape {rewards_QxK.shape}, expected "
                       f"({len(qids)}, {k}) for {len(qids)} question ids and K={k}")
    if len(trajectories) != len(qids):
      raise ValueError(f"replay update: {len(trajectories)} trajectory groups for "
                       f"{len(qids)} question ids")
    correct_QxK = rewards_QxK >= self.config.correct_threshold
    counts_Q = correct_QxK.sum(axis=1)
    bucket_Q = counts_Q if buckets_Q is None else np.asarray(buckets_Q)
    if bucket_Q.shape != (len(qids),) or bucket_Q.dtype.kind not in "iu":
      raise ValueError(f"replay update: buckets_Q is {bucket_Q.dtype}{list(bucket_Q.shape)}, "
                       f"expected integers of shape ({len(qids)},)")

    newly_retired = [q for q in dict.fromkeys(q for q, n in zip(qids, counts_Q) if n == k)
                     if q not in self._retired]
    for q in newly_retired:
      self._retire(q)
    summary = dict(retired=len(newly_retired), stored=0, duplicates=0, evicted=0)
    if not collect:
      return summary

    new_bucket, add_q, add_ids, add_logps = {}, [], [], []
    for q, b, correct_K, group in zip(qids, bucket_Q.tolist(), correct_QxK.tolist(),
                                      trajectories):
      if q in self._retired or not 0 < b < k:
        continue
      if len(group) != k:
        raise ValueError(f"replay update: question {q} has {len(group)} trajectories, "
                         f"expected K={k}")
      new_bucket[q] = b
      for item, correct in zip(group, correct_K):
        if correct:
          add_q.append(q)
          add_ids.append(item[0])
          add_logps.append(item[1])
    summary["stored"] = self._store.add(add_q, add_ids, add_logps, step)
    summary["duplicates"] = len(add_q) - summary["stored"]

    emptied = []
    if self.config.max_per_question:
      for q in dict.fromkeys(add_q):
        summary["evicted"] += self._store.evict_question(q, self.config.max_per_question)
    if self.config.max_total:
      evicted, emptied = self._store.evict_oldest(self.config.max_total)
      summary["evicted"] += evicted
    self._evicted += summary["evicted"]
    for q, b in new_bucket.items():
      if self._store.count(q):
        self._set_bucket(q, b)
    for q in emptied:
      self._set_bucket(q, None)
    return summary

  # --- sampling, docs/algorithm.md §4 ------------------------------------------------------

  def sample_questions(self, n: int) -> np.ndarray:
    """Draws min(n, num_candidates) distinct candidate questions, in random order.

    Bucket counts are multinomial under `buckets.bucket_probs`, capped at bucket sizes
    with the surplus handed to buckets with room; questions are uniform without
    replacement inside a bucket.
    """
    sizes_B = np.array([len(m) for m in self._members])
    n = min(int(n), int(sizes_B.sum()))
    if n <= 0:
      return np.empty(0, np.int64)
    probs_B = buckets.bucket_probs(sizes_B, mu=self.config.mu, sigma=self.config.sigma_acc,
                                   weighting=self.config.weighting)
    counts_B = buckets.capped_multinomial(n, probs_B, sizes_B, self._rng)
    picks = []
    for b in np.flatnonzero(counts_B):
      members = self._members[b]
      picks.extend(members[i] for i in self._rng.choice(len(members), counts_B[b],
                                                        replace=False))
    out = np.array(picks, np.int64)
    self._rng.shuffle(out)
    return out

  def candidates(self, question_id: int) -> list[storage.StoredTrajectory]:
    """A buffered question's stored trajectories (token ids, log-probs, step), oldest first."""
    q = _as_question_id(question_id)
    if q not in self._bucket:
      state = "retired" if q in self._retired else "not buffered"
      raise KeyError(f"replay: question {q} has no stored trajectories ({state})")
    return self._store.trajectories(q)

  def bucket(self, question_id: int) -> int:
    """The bucket (latest correct count) of a buffered question."""
    return self._bucket[_as_question_id(question_id)]

  @property
  def question_ids(self) -> list[int]:
    """The buffered (candidate) questions, in ascending order."""
    return sorted(self._bucket)

  @property
  def retired(self) -> frozenset[int]:
    return frozenset(self._retired)

  @property
  def num_candidates(self) -> int:
    return len(self._bucket)

  @property
  def rng(self) -> np.random.Generator:
    """The buffer's generator (e.g. the `rng` of the "random" trajectory selection)."""
    return self._rng

  def stats(self) -> dict[str, int]:
    """Scalars for logging: sizes, retired count, bytes and `bucket/{k}` counts."""
    out = dict(
        questions=self.num_candidates,
        retired=len(self._retired),
        trajectories=self._store.num_trajectories,
        tokens=self._store.num_tokens,
        bytes=self._store.live_bytes(),
        allocated_bytes=self._store.allocated_bytes(),
        evicted=self._evicted,
        logp_clamped=self._store.logp_clamped,
    )
    out.update({f"bucket/{b}": len(self._members[b]) for b in range(1, self.config.k)})
    return out

  # --- checkpointing -------------------------------------------------------------------------

  def state_dict(self) -> dict[str, np.ndarray]:
    """Everything, RNG state included, as NumPy arrays (np.savez / Orbax friendly)."""
    state = {f"traj_{name}": a for name, a in self._store.state_dict().items()}
    state["bucket_members"] = np.array([q for m in self._members for q in m], np.int64)
    state["bucket_sizes"] = np.array([len(m) for m in self._members], np.int64)
    state["retired"] = np.array(sorted(self._retired), np.int64)
    meta = dict(version=_STATE_VERSION, config=dataclasses.asdict(self.config),
                rng=self._rng.bit_generator.state, evicted=self._evicted,
                logp_clamped=self._store.logp_clamped)
    state["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8).copy()
    return state

  @classmethod
  def from_state_dict(cls, state: Mapping[str, np.ndarray],
                      config: Mapping[str, Any] | None = None) -> "ExperienceBuffer":
    """Restores a buffer; `config` (default: the saved one) may change caps or sampling."""
    meta = json.loads(np.asarray(state["meta"], np.uint8).tobytes().decode())
    if meta.get("version") != _STATE_VERSION:
      raise ValueError(f"replay state version {meta.get('version')}, "
                       f"expected {_STATE_VERSION}")
    saved = BufferConfig(**meta["config"])
    new = saved if config is None else BufferConfig.from_mapping(config)
    if (new.k, new.vocab_size) != (saved.k, saved.vocab_size):
      raise ValueError(f"replay state has k={saved.k}, vocab_size={saved.vocab_size}; "
                       f"config asks for k={new.k}, vocab_size={new.vocab_size}")
    buf = cls(new)
    buf._rng.bit_generator.state = meta["rng"]
    traj = {name[len("traj_"):]: np.asarray(a) for name, a in state.items()
            if name.startswith("traj_")}
    buf._store = storage.TrajectoryStore.from_state_dict(traj, new.vocab_size,
                                                         meta["logp_clamped"])
    members = np.asarray(state["bucket_members"]).tolist()
    bounds = np.cumsum(np.concatenate([[0], state["bucket_sizes"]]))
    for b in range(new.k + 1):
      for q in members[bounds[b]:bounds[b + 1]]:
        buf._set_bucket(q, b)
    buf._retired = set(np.asarray(state["retired"]).tolist())
    buf._evicted = meta["evicted"]
    return buf

  # --- internals -----------------------------------------------------------------------------

  def _retire(self, q: int):
    self._retired.add(q)
    self._store.drop_question(q)
    self._set_bucket(q, None)

  def _set_bucket(self, q: int, b: int | None):
    """Moves a question between bucket lists (None removes it); swap-remove keeps O(1)."""
    old = self._bucket.pop(q, None)
    if old is not None:
      members, slot = self._members[old], self._slot.pop(q)
      last = members.pop()
      if last != q:
        members[slot] = last
        self._slot[last] = slot
    if b is not None:
      self._bucket[q] = b
      self._slot[q] = len(self._members[b])
      self._members[b].append(q)


def _as_question_id(q) -> int:
  if isinstance(q, (bool, np.bool_)) or not isinstance(q, (int, np.integer)):
    raise TypeError(f"replay: question ids must be integers, got {q!r} ({type(q).__name__})")
  return int(q)
