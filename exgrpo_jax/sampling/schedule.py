"""The host's decisions of continuous batching, chunk by chunk, apart from the device.

  scheduler = Scheduler(table, prompt_len_R, max_new_tokens, chunk_steps, keep_free)
  while (chunk := scheduler.plan()) is not None:
    ...release chunk.stopped_B, select chunk.keep_C, repage chunk.source_Q, admit
    chunk.new_rows into chunk.free, decode; then per live slot b:
    scheduler.advance(b, steps, done)

`Scheduler.plan` decides, before a chunk, which rows are preempted (`_preempted`), which
waiting rows are admitted into which free slots (`_free_slots`, `pages.PageTable.room`),
whether the tail moves into fewer slots (`_tail_slots`) and the pool's size
(`PageTable.fit`); `continuous.generate` carries them out on the device in that order.
None of it looks at tokens, so `simulate` runs the same decisions for rows of given
lengths without a model: the pool sizes, pages and slots a rollout of that length
distribution would use (the AOT planner's step estimates, `scripts/bench/pool_ladder.py`).
"""

import collections
import dataclasses

import numpy as np

from exgrpo_jax.sampling import decode
from exgrpo_jax.sampling import pages as pages_lib


@dataclasses.dataclass
class Chunk:
  """One chunk's decisions, in the order the device carries them out."""
  stopped_B: np.ndarray      # bool [B]: slots whose row was preempted (its pages freed)
  free: np.ndarray           # slots admitting a row, ...
  new_rows: np.ndarray       # ... these (a row with tokens already resumes)
  keep_C: np.ndarray | None  # the slots kept for the tail (`slots.select`), or None
  source_Q: np.ndarray | None  # the pool's new page order (`slots.repage`), or None


class Scheduler:
  """Rows of a request in the slots of a `pages.PageTable` (see the module docstring)."""

  def __init__(self, table: pages_lib.PageTable, prompt_len_R: np.ndarray,
               max_new_tokens: int, chunk_steps: int, keep_free: int = 0):
    self.table, self.prompt_len_R = table, np.asarray(prompt_len_R)
    self.N, self.steps, self.keep_free = max_new_tokens, chunk_steps, keep_free
    self.lengths_R = np.zeros(len(self.prompt_len_R), np.int32)
    self.slot_row_B = np.full(table.slots, -1)
    self.admitted_B = np.zeros(table.slots, np.int64)  # admission number (newest: most)
    self.admissions = 0
    self.pending = collections.deque(range(len(self.prompt_len_R)))  # preempted first

  def end_of(self, r):
    """The address after row r's (rows r's) next chunk."""
    return self.prompt_len_R[r] + np.minimum(self.lengths_R[r] + self.steps, self.N)

  def plan(self, forced=()) -> Chunk | None:
    """The next chunk's decisions (`forced`: more slots to preempt, tests), or None when
    every row is done."""
    table, shards = self.table, self.table.shards
    ends_B = np.where(self.slot_row_B >= 0, self.end_of(np.maximum(self.slot_row_B, 0)), 0)
    stopped_B = np.zeros(self.slot_row_B.size, bool)
    for b in [*forced, *_preempted(table, ends_B, self.admitted_B, shards, forced)]:
      self.pending.appendleft(self.slot_row_B[b])  # waits first in line, tokens kept
      self.slot_row_B[b], ends_B[b], stopped_B[b] = -1, 0, True
      table.release(b)
    free, new_rows = [], []
    need_S, full = table.need(ends_B), set()  # full: shards without room for the next
    for b in _free_slots(self.slot_row_B, shards):
      if not self.pending or len(full) == shards:
        break
      s = table.shard_of(b)
      if s in full:
        continue
      end = self.end_of(self.pending[0])
      if not table.room(need_S[s], end, self.keep_free):
        full.add(s)
      else:
        need_S[s] += -(-end // table.T)
        full.clear()
        free.append(b)
        new_rows.append(self.pending.popleft())
        table.release(b)
        self.admissions += 1
        self.slot_row_B[b], ends_B[b] = new_rows[-1], self.end_of(new_rows[-1])
        self.admitted_B[b] = self.admissions
    if (self.slot_row_B < 0).all():
      return None
    # Not in a round that admits rows: they are placed into the slots they were given.
    keep_C = (_tail_slots(self.slot_row_B, shards) if not self.pending and not free
              else None)
    if keep_C is not None:  # the pool stays where it is: only the slots move
      table.select(keep_C)
      self.slot_row_B, self.admitted_B = self.slot_row_B[keep_C], self.admitted_B[keep_C]
      ends_B = ends_B[keep_C]
    return Chunk(stopped_B, np.array(free, np.int64), np.array(new_rows, np.int64), keep_C,
                 table.fit(ends_B))

  def live(self) -> np.ndarray:
    return np.flatnonzero(self.slot_row_B >= 0)

  def advance(self, b: int, steps: int, done: bool) -> None:
    """Slot b's row has emitted `steps` tokens in all; `done`: it ended, its slot is free."""
    self.lengths_R[self.slot_row_B[b]] = steps
    if done:
      self.slot_row_B[b] = -1
      self.table.release(b)


def _preempted(table, ends_B, admitted_B, shards: int, gone=()) -> list[int]:
  """The slots to preempt so that every shard holds its live rows' next chunk: in each
  shard that cannot, its newest rows (the last admitted) until it can, as vLLM's
  scheduler does. The oldest row always stays: a row at its longest fits a shard.
  Slots `gone` are preempted already."""
  per = ends_B.size // shards
  ends_B, out = ends_B.copy(), []
  ends_B[list(gone)] = 0
  for s in np.flatnonzero(table.need(ends_B) > table.capacity_per_shard):
    mine = np.arange(s * per, (s + 1) * per)
    for b in mine[np.argsort(-admitted_B[mine])]:
      if table.need(ends_B)[s] <= table.capacity_per_shard:
        break
      if ends_B[b]:
        out.append(int(b))
        ends_B[b] = 0
  return out


def _free_slots(slot_row_B, shards: int):
  """The free slots, in the order that fills the shard with the fewest rows first: the
  pool is sized by its fullest shard (`pages.PageTable`), and the tail by its shard
  with the most live rows (`_tail_slots`)."""
  per = slot_row_B.size // shards
  free = np.flatnonzero(slot_row_B < 0)
  shard_F = free // per
  rows_S = per - np.bincount(shard_F, minlength=shards)
  rank_F = np.arange(free.size) - np.searchsorted(shard_F, shard_F)  # within its shard
  return free[np.lexsort((shard_F, rows_S[shard_F] + rank_F))]


def _tail_slots(slot_row_B, shards: int):
  """The slots to keep once no row waits: C = `shards` x bucket(the most live rows of a
  shard), each shard's live slots, then its ended ones, in its C / shards; None unless
  C <= B / 2.

  A tail step of few live rows then costs a step of C rows, not B. Halving at least
  bounds the shrinks to log2(B) per call, each a copy of the kept slots, and keeps the
  slot counts to a few program shapes. A row keeps its shard (the mesh's split of the
  slots), so its pages stay on its device (`pages.PageTable`).
  """
  slot_SxB = np.arange(slot_row_B.size).reshape(shards, -1)
  live_SxB = slot_row_B[slot_SxB] >= 0
  per = decode.bucket(int(live_SxB.sum(axis=1).max()))
  if 2 * per * shards > slot_row_B.size:
    return None
  keep = [np.concatenate([slots[live], slots[~live]])[:per]
          for slots, live in zip(slot_SxB, live_SxB)]
  return np.concatenate(keep).astype(np.int32)


@dataclasses.dataclass
class Trace:
  """What a rollout did, chunk by chunk (`simulate`): the decode steps each chunk ran,
  its slots, live rows, the pool's pages, the pages live rows held and the rows placed
  before it; the preemptions, and the resumed rows and their tokens run again."""
  steps_C: np.ndarray
  slots_C: np.ndarray
  rows_C: np.ndarray
  pool_pages_C: np.ndarray
  held_pages_C: np.ndarray
  admitted_C: np.ndarray
  preemptions: int
  resumed: int
  recomputed_tokens: int

  @property
  def pool_sizes(self) -> list[int]:
    """The pool sizes used, in first-use order: a decode program each."""
    return list(dict.fromkeys(self.pool_pages_C.tolist()))


def simulate(lengths_R, prompt_len_R, table: pages_lib.PageTable, max_new_tokens: int,
             chunk_steps: int, keep_free: int = 0) -> Trace:
  """The chunks `continuous.generate` runs for rows that emit `lengths_R` tokens each
  (at most `max_new_tokens`) in `table`'s slots and pool, without a model."""
  lengths_R = np.clip(np.asarray(lengths_R), 1, max_new_tokens)
  scheduler = Scheduler(table, prompt_len_R, max_new_tokens, chunk_steps, keep_free)
  steps, slots, rows, pool, held, admitted = [], [], [], [], [], []
  preemptions = resumed = recomputed = 0
  while (chunk := scheduler.plan()) is not None:
    preemptions += int(chunk.stopped_B.sum())
    resumed += int((scheduler.lengths_R[chunk.new_rows] > 0).sum())
    recomputed += int(scheduler.lengths_R[chunk.new_rows].sum())
    admitted.append(chunk.new_rows.size)
    live = scheduler.live()
    done_R = scheduler.lengths_R[scheduler.slot_row_B[live]]
    left = lengths_R[scheduler.slot_row_B[live]] - done_R
    taken = int(min(chunk_steps, left.max()))
    steps.append(taken)
    slots.append(table.slots)
    rows.append(live.size)
    pool.append(table.pages)
    held.append(int(table.held_B.sum()))
    scheduler.lengths_R[scheduler.slot_row_B[live]] = done_R + np.minimum(taken, left)
    for b in live[left <= taken]:
      scheduler.advance(b, scheduler.lengths_R[scheduler.slot_row_B[b]], True)
  return Trace(np.array(steps), np.array(slots), np.array(rows), np.array(pool),
               np.array(held), np.array(admitted), preemptions, resumed, recomputed)
