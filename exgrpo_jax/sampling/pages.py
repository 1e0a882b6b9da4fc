"""The host's page table for continuous batching: which pool pages each slot's row holds.

A row addresses its KV cache by position: address a is the key/value of its token at
position a (its prompt from 0, then its step-t token at prompt length + t). Its cache is
cut into pages of T addresses, and its page j (addresses jT to jT + T - 1) is the pool
page `table_BxN[b, j]` (-1: none). A row gets each page only when its next chunk reaches
it, so the pool holds what the live rows have written, not B times the longest row. The
pool takes one of the sizes of a ladder (`ladder`, multiples of the mesh's batch split)
up to its capacity (`capacity`, `rollout.kv_pages`; by default every slot's row at its
longest): XLA's attention reads the whole pool every step, so there POOL_STEPS equal
steps and halves below the first down to one row per shard; the TPU kernel reads only a
row's own pages, so there one size, the capacity, allocated once and never moved. `fit`
picks the smallest size that holds the next chunk's pages and, when that changes, the
pool's new page order (`slots.repage`): the held pages first.
Below that default the pool cannot hold every slot's row at its longest: the scheduler
admits a row only where its shard has the pages for its next chunk, and preempts rows
when they run out (`continuous`), using `need`, `room` and `capacity_per_shard`.

On a mesh the slots and the pool's pages are both split over the batch axes into
`shards` equal parts; a row's pages are always in its slot's part of the pool, so the
device holding a row also holds its pages (the paged-attention kernel reads them there,
`paged_kernel`). A row never changes shards (`select` keeps it on its own), so a resize
moves each device's pages on that device (`slots.repage_layer`).
"""

import math

import numpy as np

from exgrpo_jax.sampling import decode

PAGE = 64  # the engine's page size (tokens)
# XLA's attention reads the whole pool each step: POOL_STEPS equal steps up to the
# capacity, then halves down to one row per shard (scripts/bench/pool_ladder.py weighs the
# decode programs a finer ladder compiles against the pool a coarser one reads in vain).
# The TPU kernel reads only each row's pages, so a smaller pool would save no reads, only
# cost resizes and programs: one size.
POOL_STEPS = 32
# `rollout.kv_headroom`'s default: the share of a capped pool's pages kept free when
# admitting a row beside running ones (fewer preemptions).
KV_HEADROOM = 0.1


def pages_per_row(prompt_tokens: int, response_tokens: int) -> int:
  """The engine's pages of one row at its longest: the prompt, bucketed as the engine
  buckets it, and every response token."""
  return -(-(decode.length_bucket(prompt_tokens, 16) + response_tokens) // PAGE)


def ladder(full: int, per_row: int, shards: int, kernel: bool = False) -> list[int]:
  """The pool's sizes, ascending: for XLA's attention k x full / POOL_STEPS for k = 1 ..
  POOL_STEPS (steps of at least a row's `per_row` pages: no more programs for a small
  pool), then halves of the smallest down to one row per shard, each a multiple of
  `shards`; for the TPU kernel `full` alone."""
  if kernel:
    return [full]
  round_up = lambda n: -(-n // shards) * shards
  unit = round_up(max(-(-full // POOL_STEPS), per_row))
  sizes = {min(unit * k, full) for k in range(1, -(-full // unit) + 1)}
  size, floor = unit, per_row * shards
  while size > floor:
    size = max(size / 2, floor)
    sizes.add(min(round_up(math.ceil(size)), full))
  return sorted(sizes)


class PageTable:
  """Pages of a pool of `pages` pages, held by B slots (see the module docstring)."""

  def __init__(self, slots: int, page_size: int, prompt_len: int, max_new_tokens: int,
               shards: int, capacity: int | None = None,
               kernel: bool = False):
    self.T, self.L, self.shards = page_size, prompt_len, shards
    self.capped = capacity is not None
    pages_per_row = -(-(prompt_len + max_new_tokens) // page_size)
    round_up = lambda n, m: -(-n // m) * m
    # Every slot at its longest (the static loop's cache), or less where asked.
    full = round_up(slots * pages_per_row, shards)
    if capacity is not None:
      if capacity // shards < pages_per_row:
        raise ValueError(
            f"rollout.kv_pages={capacity}: {capacity // shards} pages per shard of the "
            f"rollout's {shards}, fewer than one row at its longest ({pages_per_row} pages "
            f"of {page_size} for {prompt_len} prompt + {max_new_tokens} new tokens), which "
            "could never finish; raise it or lower rollout.max_new_tokens")
      full = min(full, capacity // shards * shards)
    self.sizes = ladder(full, pages_per_row, shards, kernel)
    self.table_BxN = np.full((slots, pages_per_row), -1)
    self.held_B = np.zeros(slots, np.int64)  # a row's pages are always its first ones
    self.owner_P = np.full(self.sizes[0], -1)  # the slot holding each page (-1: free)

  @property
  def pages(self) -> int:
    return self.owner_P.size

  @property
  def slots(self) -> int:
    return self.table_BxN.shape[0]

  def release(self, b: int) -> None:
    """Slot b's row ended (or b takes a new row): its pages are free."""
    self.owner_P[self.table_BxN[b, :self.held_B[b]]] = -1
    self.table_BxN[b], self.held_B[b] = -1, 0

  def select(self, keep_C: np.ndarray) -> None:
    """Slots `keep_C` become slots 0 .. C - 1 (`slots.select`); the others hold no page.
    Each kept slot's new one is in the same shard: its pages stay where they are."""
    C = keep_C.size
    if C % self.shards or (keep_C // (self.slots // self.shards)
                           != np.arange(C) // (C // self.shards)).any():
      raise ValueError(f"select {keep_C.tolist()} moves a row out of its shard "
                       f"({self.shards} shards of {self.slots} slots)")
    slot_of = np.full(self.slots, -1)
    slot_of[keep_C] = np.arange(C)
    self.table_BxN, self.held_B = self.table_BxN[keep_C], self.held_B[keep_C]
    self.owner_P = np.where(self.owner_P >= 0, slot_of[self.owner_P], -1)

  def shard_of(self, b):
    """The shard of slot(s) b."""
    return b // (self.slots // self.shards)

  @property
  def capacity_per_shard(self) -> int:
    return self.sizes[-1] // self.shards

  def keep_free(self, headroom: float) -> int:
    """The pages of a shard kept free when admitting a row beside running ones: `headroom`
    of its capacity, none where the pool holds every slot's row at its longest."""
    return int(headroom * self.capacity_per_shard) if self.capped else 0

  def need(self, ends_B: np.ndarray) -> np.ndarray:
    """[shards]: the pages each shard's slots need for their addresses below `ends_B`."""
    return (-(-np.asarray(ends_B) // self.T)).reshape(self.shards, -1).sum(axis=1)

  def room(self, need: float, end: int, keep_free: int) -> bool:
    """Whether a shard whose slots need `need` pages has those of a row's addresses
    below `end` too, with `keep_free` pages to spare (an empty shard always does: one
    row at its longest fits, `__init__` checks)."""
    return not need or need + -(-end // self.T) + keep_free <= self.capacity_per_shard

  def fit(self, ends_B: np.ndarray) -> np.ndarray | None:
    """Gives each slot b the pages of its addresses below `ends_B[b]` (0: none).

    Returns, when the pool's size changes, `slots.repage`'s source: for each new page,
    the old page it is (out of range: a new, empty page), always in the same shard;
    else None.
    """
    last_B = -(-ends_B // self.T)
    need = self.need(ends_B).max()
    if need > self.capacity_per_shard:
      raise ValueError(f"the next chunk needs {need:.0f} pages of a shard, more than the "
                       f"pool's {self.capacity_per_shard} (the scheduler preempts first)")
    size = next(s for s in self.sizes if s // self.shards >= need)
    source_Q = None
    if size != self.pages:
      held = np.flatnonzero(self.owner_P >= 0)
      held_shard = held // (self.pages // self.shards)
      per = size // self.shards
      source_Q = np.full(size, self.pages)  # out of range: empty
      for s in range(self.shards):  # each shard's held pages first, in their order
        mine = held[held_shard == s]
        source_Q[s * per:s * per + mine.size] = mine
      kept = source_Q < self.pages
      new_index = np.full(self.pages, -1)
      new_index[source_Q[kept]] = np.flatnonzero(kept)
      self.table_BxN = np.where(self.table_BxN >= 0, new_index[self.table_BxN], -1)
      self.owner_P = np.where(kept, self.owner_P[np.where(kept, source_Q, 0)], -1)
    # The missing pages in slot order, then page order: each shard's first free pages.
    # Slot b misses its pages held_B[b] .. last_B[b] - 1.
    count_B = np.maximum(last_B - self.held_B, 0)
    miss_b = np.repeat(np.arange(self.slots), count_B)
    miss_j = np.arange(miss_b.size) - np.repeat(np.cumsum(count_B) - count_B - self.held_B,
                                                count_B)
    self.held_B = np.maximum(self.held_B, last_B)
    per = self.pages // self.shards
    shard_M = self.shard_of(miss_b)
    for s in np.unique(shard_M):
      mine = shard_M == s
      given = np.flatnonzero(self.owner_P[s * per:(s + 1) * per] < 0)[:mine.sum()] + s * per
      self.table_BxN[miss_b[mine], miss_j[mine]] = given
      self.owner_P[given] = miss_b[mine]
    return source_Q

  def device_args(self):
    """(table_BxN with P for no page, owner_P with B for free, base_P: first address)."""
    B, P = self.slots, self.pages
    held_b, held_j = np.nonzero(self.table_BxN >= 0)
    base_P = np.zeros(P, np.int32)
    base_P[self.table_BxN[held_b, held_j]] = held_j * self.T
    return (np.where(self.table_BxN >= 0, self.table_BxN, P).astype(np.int32),
            np.where(self.owner_P >= 0, self.owner_P, B).astype(np.int32), base_P)

  def prompt_pages(self, slot_A: np.ndarray, length: int | None = None) -> np.ndarray:
    """[A, ceil(length / T)]: the pool pages of the first `length` (default: the prompt
    bucket L) addresses of the rows in slots `slot_A` (out of range: no row) for
    `slots.place`; P where there is none."""
    N = -(-(length or self.L) // self.T)
    rows = self.table_BxN[np.minimum(slot_A, self.slots - 1), :N]
    rows = np.where((slot_A < self.slots)[:, None] & (rows >= 0), rows, self.pages)
    # A bucketed length may pass a row's last page: those addresses are padding.
    rows = np.pad(rows, [(0, 0), (0, N - rows.shape[1])], constant_values=self.pages)
    return rows.astype(np.int32)
