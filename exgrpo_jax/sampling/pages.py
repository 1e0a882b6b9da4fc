"""The host's page table for continuous batching: which pool pages each slot's row holds.

A row addresses its KV cache by position: address a is the key/value of its token at
position a (its prompt from 0, then its step-t token at prompt length + t). Its cache is
cut into pages of T addresses, and its page j (addresses jT to jT + T - 1) is the pool
page `table_BxN[b, j]` (-1: none). A row gets each page only when its next chunk reaches
it, so the pool holds what the live rows have written, not B times the longest row. The
pool takes one of a few sizes (steps of at least a row's pages, multiples of the mesh's
batch split); `fit` picks the smallest that holds the next chunk's pages and, when that
changes, the pool's new page order (`slots.repage`): the held pages first.

On a mesh the slots and the pool's pages are both split over the batch axes into
`shards` equal parts; a row's pages are always in its slot's part of the pool, so the
device holding a row also holds its pages (the paged-attention kernel reads them there,
`paged_kernel`). A row never changes shards (`select` keeps it on its own), so a resize
moves each device's pages on that device (`slots.repage_layer`).
"""

import numpy as np


class PageTable:
  """Pages of a pool of `pages` pages, held by B slots (see the module docstring)."""

  def __init__(self, slots: int, page_size: int, prompt_len: int, max_new_tokens: int,
               sizes: int, shards: int):
    self.T, self.L, self.shards = page_size, prompt_len, shards
    pages_per_row = -(-(prompt_len + max_new_tokens) // page_size)
    full = slots * pages_per_row  # every slot at its longest: the static loop's cache
    # Sizes step by 1/`sizes` of that, but never by less than a row's pages: more sizes
    # would mean more programs to compile for short rollouts, for little saved.
    round_up = lambda n, m: -(-n // m) * m
    unit = round_up(max(-(-full // sizes), pages_per_row), shards)
    self.sizes = [min(unit * k, round_up(full, shards))
                  for k in range(1, -(-full // unit) + 1)]
    self.table_BxN = np.full((slots, pages_per_row), -1)
    self.owner_P = np.full(self.sizes[0], -1)  # the slot holding each page (-1: free)

  @property
  def pages(self) -> int:
    return self.owner_P.size

  @property
  def slots(self) -> int:
    return self.table_BxN.shape[0]

  def release(self, b: int) -> None:
    """Slot b's row ended (or b takes a new row): its pages are free."""
    held = self.table_BxN[b][self.table_BxN[b] >= 0]
    self.owner_P[held] = -1
    self.table_BxN[b] = -1

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
    self.table_BxN = self.table_BxN[keep_C]
    self.owner_P = np.where(self.owner_P >= 0, slot_of[self.owner_P], -1)

  def _shard_of_slot(self, b):
    return b // (self.slots // self.shards)

  def fit(self, ends_B: np.ndarray) -> np.ndarray | None:
    """Gives each slot b the pages of its addresses below `ends_B[b]` (0: none).

    Returns, when the pool's size changes, `slots.repage`'s source: for each new page,
    the old page it is (out of range: a new, empty page), always in the same shard;
    else None.
    """
    last_B = -(-ends_B // self.T)
    need_S = np.bincount(self._shard_of_slot(np.arange(self.slots)), weights=last_B,
                         minlength=self.shards)
    size = next(s for s in self.sizes if s // self.shards >= need_S.max())
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
    per = self.pages // self.shards
    for b in np.flatnonzero(last_B > 0):
      row = self.table_BxN[b, :last_B[b]]
      missing = row < 0
      if missing.any():
        s = self._shard_of_slot(b)
        free = np.flatnonzero(self.owner_P[s * per:(s + 1) * per] < 0) + s * per
        given = free[:missing.sum()]
        row[missing] = given
        self.owner_P[given] = b
    return source_Q

  def device_args(self):
    """(table_BxN with P for no page, owner_P with B for free, base_P: first address)."""
    B, P = self.slots, self.pages
    held_b, held_j = np.nonzero(self.table_BxN >= 0)
    base_P = np.zeros(P, np.int32)
    base_P[self.table_BxN[held_b, held_j]] = held_j * self.T
    return (np.where(self.table_BxN >= 0, self.table_BxN, P).astype(np.int32),
            np.where(self.owner_P >= 0, self.owner_P, B).astype(np.int32), base_P)

  def prompt_pages(self, slot_A: np.ndarray) -> np.ndarray:
    """[A, ceil(L / T)]: the pool pages of the prompts of the rows in slots `slot_A`
    (out of range: no row) for `slots.place`; P where there is none."""
    N = -(-self.L // self.T)
    rows = self.table_BxN[np.minimum(slot_A, self.slots - 1), :N]
    rows = np.where((slot_A < self.slots)[:, None] & (rows >= 0), rows, self.pages)
    return rows.astype(np.int32)
