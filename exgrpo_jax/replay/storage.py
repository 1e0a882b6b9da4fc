"""Compact host-side storage of replayable trajectories: token ids and behaviour log-probs.

Every stored token costs 4 or 5 bytes:
  * token id: a uint16 low half, plus a uint8 high byte when the vocabulary has more than
    65,536 entries (Qwen's 152,064 needs 18 bits; ids up to 2^24 fit);
  * behaviour log-prob: uint16 fixed point in the log domain, q = round(-logp / 2^-10).
    The importance ratio exp(logp_new - logp_stored) then carries a relative error of at
    most 2^-11 = 4.9e-4 from storage, uniformly over logp in [-64, 0]. float16 would
    give |logp| * 2^-11 (5e-3 at logp = -10) and bfloat16 eight times that. Log-probs
    below -64 nats (p < 1.6e-28) are clamped and counted.

Payload lives in one contiguous arena (no per-trajectory NumPy objects), trajectories in a
record table in insertion order (question, offset, length, step, dedup hash). Removing
trajectories leaves holes; the arena and the table are compacted in place once half of
either is dead.
"""

import zlib
from typing import NamedTuple

import numpy as np

LOGP_STEP = 2.0 ** -10
_MAX_CODE = np.iinfo(np.uint16).max
LOGP_MIN = -LOGP_STEP * _MAX_CODE
_LOW_BITS = 16
_MAX_WIDE_VOCAB = 1 << 24
_MIN_CAPACITY = 1 << 16
_GROWTH = 1.5
_RECORD_DTYPE = np.dtype([("qid", np.int64), ("offset", np.int64), ("length", np.int32),
                          ("step", np.int32), ("hash", np.uint64), ("alive", np.bool_)])


class StoredTrajectory(NamedTuple):
  """One replayable response: token ids (EOS included), behaviour log-probs, step."""

  token_ids: np.ndarray  # int32 [L]
  logps: np.ndarray  # float32 [L]
  step: int


def encode_logps(logp_N: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
  """Quantises log-probs (as float32) to uint16 codes; returns (codes, number clamped)."""
  # Scaling by a power of two is exact in float32, so only the rounding below is lossy.
  scaled = np.multiply(logp_N, np.float32(-1.0 / LOGP_STEP), dtype=np.float32)
  clamped = int(np.count_nonzero(scaled > _MAX_CODE))
  np.clip(scaled, 0.0, _MAX_CODE, out=scaled)
  np.rint(scaled, out=scaled)
  if out is None:
    return scaled.astype(np.uint16), clamped
  out[...] = scaled
  return out, clamped


def decode_logps(codes_N: np.ndarray) -> np.ndarray:
  return codes_N.astype(np.float32) * np.float32(-LOGP_STEP)


def token_hash(token_ids: np.ndarray) -> int:
  """Deduplication key: CRC-32 of the int32 ids and the length (matches are then compared
  token by token, so collisions cost a comparison, never a lost trajectory)."""
  ids = np.ascontiguousarray(token_ids, np.int32)
  return (len(ids) << 32) | zlib.crc32(ids)


class TrajectoryStore:
  """Trajectories grouped by question, oldest first, with dedup and oldest-first eviction."""

  def __init__(self, vocab_size: int | None = None):
    if vocab_size is not None and not 0 < vocab_size <= _MAX_WIDE_VOCAB:
      raise ValueError(f"replay vocab_size must be in [1, {_MAX_WIDE_VOCAB}], got {vocab_size}")
    self.vocab_size = vocab_size
    self.wide = vocab_size is None or vocab_size > (1 << _LOW_BITS)
    self._lo = np.empty(0, np.uint16)
    self._hi = np.empty(0, np.uint8) if self.wide else None
    self._logq = np.empty(0, np.uint16)
    self._records = np.empty(0, _RECORD_DTYPE)
    self._num_records = 0  # records in the table, dead ones included
    self._num_live = 0
    self._used_tokens = 0
    self._dead_tokens = 0
    self._oldest = 0  # no live record before this index
    self._by_question: dict[int, list[int]] = {}
    self.logp_clamped = 0

  # --- queries ---------------------------------------------------------------------------

  @property
  def num_trajectories(self) -> int:
    return self._num_live

  @property
  def num_tokens(self) -> int:
    return self._used_tokens - self._dead_tokens

  def count(self, qid: int) -> int:
    return len(self._by_question.get(qid, ()))

  def trajectories(self, qid: int) -> list[StoredTrajectory]:
    """The stored trajectories of a question, oldest first (empty if none)."""
    return [self._read(r) for r in self._by_question.get(qid, ())]

  def bytes_per_token(self) -> int:
    return 2 + 2 + (1 if self.wide else 0)

  def live_bytes(self) -> int:
    """Bytes of live payload and records (what a compacted copy would hold)."""
    return (self.num_tokens * self.bytes_per_token()
            + self.num_trajectories * _RECORD_DTYPE.itemsize)

  def allocated_bytes(self) -> int:
    arrays = [self._lo, self._hi, self._logq, self._records]
    return sum(a.nbytes for a in arrays if a is not None)

  # --- mutation ----------------------------------------------------------------------------

  def add(self, qids: list[int], token_ids: list[np.ndarray], logps: list[np.ndarray],
          step: int) -> int:
    """Appends trajectories (deduplicated per question by token ids); returns how many.

    Raises ValueError naming the question and item for empty or mismatched arrays,
    non-integer or out-of-vocabulary token ids, or NaN log-probs.
    """
    keep, hashes, seen = [], [], {}
    for i, qid in enumerate(qids):
      ids, logp = np.asarray(token_ids[i]), np.asarray(logps[i])
      if ids.ndim != 1 or not ids.size or logp.shape != ids.shape:
        raise ValueError(f"replay: question {qid} item {i}: token ids {ids.shape} and "
                         f"log-probs {logp.shape} must be equal non-empty 1-D arrays")
      h = token_hash(ids)
      twins = seen.get((qid, h))
      if twins is None:
        twins = seen[(qid, h)] = []
      elif any(np.array_equal(token_ids[j], ids) for j in twins):
        continue
      if self._is_duplicate(qid, ids, h):
        continue
      twins.append(i)
      keep.append(i)
      hashes.append(h)
    if not keep:
      return 0
    ids_N = np.concatenate([token_ids[i] for i in keep])
    logp_N = np.concatenate([logps[i] for i in keep], dtype=np.float32)
    self._check(ids_N, logp_N, [qids[i] for i in keep], [token_ids[i] for i in keep],
                [logps[i] for i in keep])
    lengths = np.array([len(token_ids[i]) for i in keep], np.int64)
    self._reserve(len(ids_N), len(keep))
    start = self._used_tokens
    end = start + len(ids_N)
    np.bitwise_and(ids_N, 0xFFFF, out=self._lo[start:end], casting="unsafe")
    if self.wide:
      np.right_shift(ids_N, _LOW_BITS, out=self._hi[start:end], casting="unsafe")
    _, clamped = encode_logps(logp_N, out=self._logq[start:end])
    self.logp_clamped += clamped
    first = self._num_records
    rec = self._records[first:first + len(keep)]
    rec["qid"] = [qids[i] for i in keep]
    rec["offset"] = start + _starts(lengths)
    rec["length"] = lengths
    rec["step"] = step
    rec["hash"] = np.array(hashes, np.uint64)
    rec["alive"] = True
    for r, i in enumerate(keep, start=first):
      self._by_question.setdefault(qids[i], []).append(r)
    self._num_records += len(keep)
    self._num_live += len(keep)
    self._used_tokens = end
    return len(keep)

  def drop_question(self, qid: int) -> int:
    """Removes every trajectory of a question; returns how many."""
    recs = self._by_question.pop(qid, [])
    for r in recs:
      self._kill(r)
    self._maybe_compact()
    return len(recs)

  def evict_question(self, qid: int, cap: int) -> int:
    """Evicts a question's oldest trajectories beyond `cap`; returns how many."""
    recs = self._by_question.get(qid, [])
    evicted = max(len(recs) - cap, 0)
    for r in recs[:evicted]:
      self._kill(r)
    del recs[:evicted]
    self._maybe_compact()
    return evicted

  def evict_oldest(self, max_total: int) -> tuple[int, list[int]]:
    """Evicts the oldest trajectories beyond `max_total` in all; returns (how many,
    questions left without trajectories)."""
    evicted, emptied = 0, []
    while self.num_trajectories > max_total:
      while not self._records[self._oldest]["alive"]:
        self._oldest += 1
      qid = int(self._records[self._oldest]["qid"])
      recs = self._by_question[qid]
      self._kill(recs.pop(0))  # the globally oldest record is its question's oldest
      evicted += 1
      if not recs:
        del self._by_question[qid]
        emptied.append(qid)
    self._maybe_compact()
    return evicted, emptied

  # --- checkpointing -------------------------------------------------------------------------

  def state_dict(self) -> dict[str, np.ndarray]:
    """Live trajectories in insertion order, as plain arrays."""
    live, runs = self._live_runs()
    rec = self._records[live]
    state = {name: rec[name].copy() for name in ("qid", "length", "step", "hash")}
    arrays = {"token_lo": self._lo, "logp_code": self._logq}
    if self.wide:
      arrays["token_hi"] = self._hi
    for name, arr in arrays.items():
      state[name] = np.concatenate([arr[a:b] for a, b in runs] or [arr[:0]])
    return state

  @classmethod
  def from_state_dict(cls, state: dict[str, np.ndarray], vocab_size: int | None,
                      logp_clamped: int = 0) -> "TrajectoryStore":
    store = cls(vocab_size)
    if store.wide != ("token_hi" in state):
      raise ValueError(f"replay state token width does not match vocab_size={vocab_size}")
    n, tokens = len(state["qid"]), len(state["token_lo"])
    store._reserve(tokens, n)
    store._lo[:tokens] = state["token_lo"]
    if store.wide:
      store._hi[:tokens] = state["token_hi"]
    store._logq[:tokens] = state["logp_code"]
    rec = store._records[:n]
    for name in ("qid", "length", "step", "hash"):
      rec[name] = state[name]
    rec["offset"] = _starts(state["length"])
    rec["alive"] = True
    for r, qid in enumerate(state["qid"].tolist()):
      store._by_question.setdefault(qid, []).append(r)
    store._num_records, store._num_live, store._used_tokens = n, n, tokens
    store.logp_clamped = logp_clamped
    return store

  # --- internals -----------------------------------------------------------------------------

  def _is_duplicate(self, qid: int, ids: np.ndarray, h: int) -> bool:
    recs = self._by_question.get(qid)
    if not recs:
      return False
    matches = np.asarray(recs)[self._records["hash"][recs] == np.uint64(h)]
    return any(np.array_equal(self._read(r).token_ids, ids) for r in matches)

  def _check(self, ids_N, logp_N, qids, token_ids, logps):
    limit = self.vocab_size or _MAX_WIDE_VOCAB
    if ids_N.dtype.kind in "iu" and (ids_N.min() >= 0 and ids_N.max() < limit
                                      and not np.isnan(logp_N).any()):
      return
    for qid, ids, logp in zip(qids, token_ids, logps):
      ids = np.asarray(ids)
      if ids.dtype.kind not in "iu":
        raise ValueError(f"replay: question {qid}: token ids have dtype {ids.dtype}, "
                         "expected integers")
      bad = ids[(ids < 0) | (ids >= limit)]
      if len(bad):
        raise ValueError(f"replay: question {qid}: token id {bad[0]} is outside "
                         f"[0, {limit}) (vocab_size={self.vocab_size})")
      if np.isnan(logp).any():
        raise ValueError(f"replay: question {qid}: behaviour log-probs contain NaN")

  def _read(self, r: int) -> StoredTrajectory:
    rec = self._records[r]
    s = slice(int(rec["offset"]), int(rec["offset"]) + int(rec["length"]))
    ids = self._lo[s].astype(np.int32)
    if self.wide:
      ids |= self._hi[s].astype(np.int32) << _LOW_BITS
    return StoredTrajectory(ids, decode_logps(self._logq[s]), int(rec["step"]))

  def _kill(self, r: int):
    self._records["alive"][r] = False
    self._num_live -= 1
    self._dead_tokens += int(self._records["length"][r])

  def _reserve(self, tokens: int, records: int):
    need = self._used_tokens + tokens
    if need > len(self._lo):
      cap = max(need, int(len(self._lo) * _GROWTH), _MIN_CAPACITY)
      self._lo = _grown(self._lo, cap, self._used_tokens)
      self._logq = _grown(self._logq, cap, self._used_tokens)
      if self.wide:
        self._hi = _grown(self._hi, cap, self._used_tokens)
    need = self._num_records + records
    if need > len(self._records):
      cap = max(need, int(len(self._records) * _GROWTH), 1024)
      self._records = _grown(self._records, cap, self._num_records)

  def _live_runs(self) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Live record indices, and the arena ranges of runs of consecutive live records."""
    live = np.flatnonzero(self._records["alive"][:self._num_records])
    if not len(live):
      return live, []
    breaks = np.flatnonzero(np.diff(live) != 1)
    first, last = live[np.r_[0, breaks + 1]], live[np.r_[breaks, len(live) - 1]]
    offsets, lengths = self._records["offset"], self._records["length"]
    return live, list(zip(offsets[first].tolist(), (offsets[last] + lengths[last]).tolist()))

  def _maybe_compact(self):
    dead_records = self._num_records - self._num_live
    if 2 * self._dead_tokens <= self._used_tokens and 2 * dead_records <= self._num_records:
      return
    live, runs = self._live_runs()
    # Moving each run to the front in one copy; destinations never pass their sources,
    # so in-place copies are safe. Records are then renumbered in the same order.
    dst = 0
    for a, b in runs:
      for arr in (self._lo, self._hi, self._logq):
        if arr is not None:
          arr[dst:dst + b - a] = arr[a:b]
      dst += b - a
    new_index = np.cumsum(self._records["alive"][:self._num_records]) - 1
    rec = self._records[live]
    rec["offset"] = _starts(rec["length"])
    self._records[:len(live)] = rec
    self._num_records, self._used_tokens, self._dead_tokens = len(live), dst, 0
    self._oldest = 0
    self._by_question = {q: new_index[recs].tolist() for q, recs in self._by_question.items()}


def _starts(lengths: np.ndarray) -> np.ndarray:
  """Offsets of back-to-back segments of the given lengths, from 0."""
  ends = np.cumsum(lengths, dtype=np.int64)
  return ends - np.asarray(lengths, np.int64)


def _grown(arr: np.ndarray, capacity: int, used: int) -> np.ndarray:
  out = np.empty(capacity, arr.dtype)
  out[:used] = arr[:used]
  return out


