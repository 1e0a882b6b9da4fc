"""The host's page table for continuous batching: which pool pages each slot's row holds.

A row addresses its KV cache as the static loop does: L prompt slots (left-padded), then
address L + t for its step-t key/value. Its cache is cut into pages of T addresses, and
its page j (addresses jT to jT + T - 1) is the pool page `table_BxN[b, j]` (-1: none).
Pages of left padding alone are never given, and a row gets each further page only when
its next chunk reaches it, so the pool holds what the live rows have written, not B
times the longest row. The pool takes one of a few sizes (steps of at least a row's
pages, multiples of the mesh's batch split); `fit` picks the smallest that holds the
next chunk's pages and, when that changes, the pool's new page order (`slots.repage`):
the held pages first when it shrinks.
"""

import numpy as np


class PageTable:
  """Pages of a pool of `pages` pages, held by B slots (see the module docstring)."""

  def __init__(self, slots: int, page_size: int, prompt_len: int, max_new_tokens: int,
               sizes: int, floor: int):
    self.T, self.L = page_size, prompt_len
    pages_per_row = -(-(prompt_len + max_new_tokens) // page_size)
    full = slots * pages_per_row  # every slot at its longest: the static loop's cache
    # Sizes step by 1/`sizes` of that, but never by less than a row's pages: more sizes
    # would mean more programs to compile for short rollouts, for little saved.
    round_up = lambda n, m: -(-n // m) * m
    unit = round_up(max(-(-full // sizes), pages_per_row), floor)
    self.sizes = [min(unit * k, round_up(full, floor)) for k in range(1, -(-full // unit) + 1)]
    self.table_BxN = np.full((slots, pages_per_row), -1)
    self.first_B = np.zeros(slots, int)  # a row's first page (those before: padding)
    self.owner_P = np.full(self.sizes[0], -1)  # the slot holding each page (-1: free)

  @property
  def pages(self) -> int:
    return self.owner_P.size

  def start(self, b: int, prompt_len: int) -> None:
    """Slot b takes a row of `prompt_len` prompt tokens; its pages come with `fit`."""
    self.release(b)
    self.first_B[b] = (self.L - prompt_len) // self.T

  def release(self, b: int) -> None:
    """Slot b's row ended: its pages are free."""
    held = self.table_BxN[b][self.table_BxN[b] >= 0]
    self.owner_P[held] = -1
    self.table_BxN[b] = -1

  def select(self, keep_C: np.ndarray) -> None:
    """Slots `keep_C` become slots 0 .. C - 1 (`slots.select`); the others hold no page."""
    slot_of = np.full(self.first_B.size, -1)
    slot_of[keep_C] = np.arange(keep_C.size)
    self.table_BxN, self.first_B = self.table_BxN[keep_C], self.first_B[keep_C]
    self.owner_P = np.where(self.owner_P >= 0, slot_of[self.owner_P], -1)

  def fit(self, ends_B: np.ndarray) -> np.ndarray | None:
    """Gives each slot b the pages of its addresses below `ends_B[b]` (0: none).

    Returns, when the pool's size changes, `slots.repage`'s source: for each new page,
    the old page it is (out of range: a new, empty page); else None.
    """
    last_B = -(-ends_B // self.T)
    need = int(np.maximum(last_B - self.first_B, 0).sum())
    size = next(s for s in self.sizes if s >= need)
    source_Q = None
    if size != self.pages:
      held, free = np.flatnonzero(self.owner_P >= 0), np.flatnonzero(self.owner_P < 0)
      if held.size and held.max() >= size:
        source_Q = np.concatenate([held, free])[:size]
      else:
        source_Q = np.arange(size)
      kept = source_Q < self.pages
      new_index = np.full(self.pages, -1)
      new_index[source_Q[kept]] = np.flatnonzero(kept)
      self.table_BxN = np.where(self.table_BxN >= 0, new_index[self.table_BxN], -1)
      self.owner_P = np.where(kept, self.owner_P[np.where(kept, source_Q, 0)], -1)
    for b in np.flatnonzero(last_B > self.first_B):
      row = self.table_BxN[b, self.first_B[b]:last_B[b]]
      missing = row < 0
      if missing.any():
        given = np.flatnonzero(self.owner_P < 0)[:missing.sum()]
        row[missing] = given
        self.owner_P[given] = b
    return source_Q

  def device_args(self):
    """(table_BxN with P for no page, owner_P with B for free, base_P: first address)."""
    B, P = self.first_B.size, self.pages
    held_b, held_j = np.nonzero(self.table_BxN >= 0)
    base_P = np.zeros(P, np.int32)
    base_P[self.table_BxN[held_b, held_j]] = held_j * self.T
    return (np.where(self.table_BxN >= 0, self.table_BxN, P).astype(np.int32),
            np.where(self.owner_P >= 0, self.owner_P, B).astype(np.int32), base_P)

  def prompt_pages(self, slot_A: np.ndarray) -> np.ndarray:
    """[A, ceil(L / T)]: the pool pages of the prompts of the rows in slots `slot_A`
    (out of range: no row) for `slots.place`; P where there is none."""
    N = -(-self.L // self.T)
    rows = self.table_BxN[np.minimum(slot_A, self.first_B.size - 1), :N]
    rows = np.where((slot_A < self.first_B.size)[:, None] & (rows >= 0), rows, self.pages)
    return rows.astype(np.int32)
