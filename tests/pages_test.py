"""The page pool of continuous batching: its attention against the dense einsum attention,
and the host's page table (what each row holds through growth, compaction and moves)."""

import jax
import jax.numpy as jnp
import numpy as np

from exgrpo_jax.models import attention
from exgrpo_jax.sampling import decode_layer
from exgrpo_jax.sampling import pages


def _pool_and_dense(seed=0, B=3, K=2, G=3, Dh=8, T=4, S=12, P=11):
  """Random rows of S slots scattered over a pool of P pages (some free), and the same
  keys/values as a dense [B, S] cache with the rows' masks."""
  rng = np.random.default_rng(seed)
  k_dense = rng.standard_normal((B, K, Dh, S)).astype(np.float32)
  v_dense = rng.standard_normal((B, K, S, Dh)).astype(np.float32)
  mask_BxS = rng.random((B, S)) < 0.6
  mask_BxS[:, -1] = True  # every row attends to something
  pages_per_row = S // T
  order = rng.permutation(P)[:B * pages_per_row].reshape(B, pages_per_row)
  k_pool = rng.standard_normal((P, K, Dh, T)).astype(np.float32)  # free pages: noise
  v_pool = rng.standard_normal((P, K, T, Dh)).astype(np.float32)
  owner_P, mask_PxT = np.full(P, B), np.zeros((P, T), bool)
  for b in range(B):
    for j, p in enumerate(order[b]):
      k_pool[p] = k_dense[b, :, :, j * T:(j + 1) * T]
      v_pool[p] = v_dense[b, :, j * T:(j + 1) * T]
      owner_P[p], mask_PxT[p] = b, mask_BxS[b, j * T:(j + 1) * T]
  q = rng.standard_normal((B, K * G, Dh)).astype(np.float32)
  return (q, k_pool, v_pool, owner_P, mask_PxT), (q, k_dense, v_dense, mask_BxS), order


def test_paged_attention_equals_the_dense_attention_values_and_gradients():
  paged_args, (q, k_dense, v_dense, mask_BxS), order = _pool_and_dense()
  _, k_pool, v_pool, owner_P, mask_PxT = paged_args
  paged = lambda q, k, v: decode_layer.paged_attention(q, k, v, owner_P, mask_PxT)
  dense = lambda q, k, v: attention.einsum_attention(q[:, None], k, v, mask_BxS[:, None])[:, 0]
  np.testing.assert_allclose(paged(q, k_pool, v_pool), dense(q, k_dense, v_dense),
                             rtol=1e-6, atol=1e-6)
  weights = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * weights)
  gq, gk, gv = jax.grad(loss(paged), argnums=(0, 1, 2))(q, k_pool, v_pool)
  dq, dk, dv = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k_dense, v_dense)
  np.testing.assert_allclose(gq, dq, rtol=1e-5, atol=1e-5)
  T = k_pool.shape[-1]
  for b in range(order.shape[0]):
    for j, p in enumerate(order[b]):
      np.testing.assert_allclose(gk[p], dk[b, :, :, j * T:(j + 1) * T], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(gv[p], dv[b, :, j * T:(j + 1) * T], rtol=1e-5, atol=1e-5)
  free = owner_P == order.shape[0]
  assert free.any() and not np.asarray(gk)[free].any() and not np.asarray(gv)[free].any()


def _held(table: pages.PageTable, b: int) -> list[int]:
  return [int(p) for p in table.table_BxN[b] if p >= 0]


def test_page_table_gives_pages_as_rows_advance_and_compacts_when_the_pool_shrinks(
    monkeypatch):
  # 3 slots, pages of 4 slots, prompt bucket 8, 16 new tokens: 6 pages a row, 18 in all,
  # pool sizes 18, 9 and one row's 6 (2 steps, then a half down to a row). Addresses
  # are positions: a prompt starts at 0.
  monkeypatch.setattr(pages, "POOL_STEPS", 2)
  table = pages.PageTable(3, page_size=4, prompt_len=8, max_new_tokens=16, shards=1)
  assert table.sizes == [6, 9, 18] and table.pages == 6
  assert table.fit(np.array([7, 12, 0])) is None  # pages 0-1 and 0-2: 5 of 6
  assert len(_held(table, 0)) == 2 and len(_held(table, 1)) == 3
  before = {b: _held(table, b) for b in range(2)}
  source = table.fit(np.array([20, 12, 0]))  # slot 0 now needs pages 0-4: 8 pages
  assert table.pages == 9 and source.size == 9
  for b in (0, 1):  # the held pages kept their contents
    np.testing.assert_array_equal(source[_held(table, b)[:len(before[b])]], before[b])
  assert (source[8:] >= 6).all()  # the rest: new, empty pages
  table.fit(np.array([20, 12, 9]))  # slot 2 (1 prompt token + 8 steps): pages 0-2
  held = [_held(table, b) for b in range(3)]
  assert sorted(sum(held, [])) == sorted(set(sum(held, []))), held  # no page twice
  table_before = {b: held[b] for b in range(3)}
  table.release(0)
  source = table.fit(np.array([0, 12, 9]))  # 6 pages: the smallest pool
  assert table.pages == 6 and source.size == 6
  for b in (1, 2):  # each remaining page moved with its contents
    np.testing.assert_array_equal(source[_held(table, b)], table_before[b])
  table_BxN, owner_P, base_P = table.device_args()
  assert (table_BxN[0] == 6).all() and (owner_P[_held(table, 1)] == 1).all()
  np.testing.assert_array_equal(base_P[_held(table, 1)], [0, 4, 8])
  np.testing.assert_array_equal(base_P[_held(table, 2)], [0, 4, 8])
  np.testing.assert_array_equal(table.prompt_pages(np.array([2, 3])),
                                [table.table_BxN[2, :2], [6, 6]])
  held_by_2 = _held(table, 2)
  table.select(np.array([2, 0]))  # slot 2 becomes slot 0, slot 0 (empty) slot 1
  assert _held(table, 0) == held_by_2 and _held(table, 1) == []
  np.testing.assert_array_equal(np.flatnonzero(table.owner_P >= 0), sorted(held_by_2))
  assert (table.owner_P[held_by_2] == 0).all()


def test_the_ladder_steps_equally_then_halves_down_to_one_row_per_shard(monkeypatch):
  monkeypatch.setattr(pages, "POOL_STEPS", 4)
  assert pages.ladder(96, 6, 1) == [6, 12, 24, 48, 72, 96]
  assert pages.ladder(96, 3, 2) == [6, 12, 24, 48, 72, 96]  # one row per shard
  assert pages.ladder(96, 7, 2) == [14, 24, 48, 72, 96]  # multiples of the shards
  assert pages.ladder(96, 40, 1) == [40, 80, 96]  # steps of at least a row
  assert pages.ladder(6, 6, 1) == [6]
  # The kernel reads a row's own pages only: the pool is allocated once, at its capacity.
  assert pages.ladder(96 * 2, 2, 1, kernel=True) == [96 * 2]


def test_on_a_mesh_a_rows_pages_are_in_its_slots_part_of_the_pool(monkeypatch):
  """Slots and pages split in 2 (the mesh's batch axes): slots 0-1 use pages of the
  first half, slots 2-3 of the second; `select` keeps each row in its half, so a resize
  moves every page within its half, with its contents, and a select that would move a
  row to the other half is refused."""
  monkeypatch.setattr(pages, "POOL_STEPS", 2)
  table = pages.PageTable(4, page_size=4, prompt_len=8, max_new_tokens=8, shards=2)
  assert table.sizes == [8, 16]  # one row a shard, every row at its longest
  half = lambda: table.pages // 2
  table.fit(np.array([16, 0, 16, 5]))  # the second half needs 6 pages: the larger pool
  assert all(p < half() for p in _held(table, 0)) and len(_held(table, 0)) == 4
  assert all(p >= half() for p in _held(table, 3)) and len(_held(table, 3)) == 2
  moved = _held(table, 3)
  table.release(0)
  try:
    table.select(np.array([3, 0]))
    raise AssertionError("a row moved to the other half")
  except ValueError as e:
    assert "select [3, 0] moves a row out of its shard (2 shards of 4 slots)" in str(e)
  old_half = half()
  table.select(np.array([1, 3]))  # slot 3's row becomes slot 1: still the second half
  assert _held(table, 0) == [] and _held(table, 1) == moved
  source = table.fit(np.array([0, 5]))  # the pool shrinks to 4 pages a half
  assert source is not None and table.pages == 8 and all(p >= half() for p in _held(table, 1))
  np.testing.assert_array_equal(source[_held(table, 1)], moved)
  for s in range(2):  # every new page's source, where it has one, is in its own half
    part = source[s * half():(s + 1) * half()]
    assert ((part // old_half == s) | (part == 2 * old_half)).all(), source


def test_a_rows_pages_are_its_first_ones_through_admission_preemption_and_resizes(
    monkeypatch):
  """`held_B` (which `fit` and `release` use instead of scanning the table) is what the
  table holds: each row's pages are its first ones, each page owned by the row holding it,
  after every chunk of rollouts that admit, preempt, shrink the slots and resize the
  pool, over 1, 2 and 4 shards."""
  from exgrpo_jax.sampling import schedule  # pylint: disable=g-import-not-at-top
  fit, checked = pages.PageTable.fit, []

  def checked_fit(table, ends_B):
    source_Q = fit(table, ends_B)
    held_BxN = table.table_BxN >= 0
    np.testing.assert_array_equal(held_BxN.sum(axis=1), table.held_B)
    assert (held_BxN == (np.arange(held_BxN.shape[1]) < table.held_B[:, None])).all()
    assert (-(-ends_B // table.T) <= table.held_B).all()
    owner_P = np.full(table.pages, -1)
    owner_P[table.table_BxN[held_BxN]] = np.nonzero(held_BxN)[0]
    np.testing.assert_array_equal(owner_P, table.owner_P)
    checked.append(source_Q is not None)
    return source_Q

  monkeypatch.setattr(pages.PageTable, "fit", checked_fit)
  rng = np.random.default_rng(0)
  preempted = 0
  for shards in (1, 2, 4):
    for capacity_rows in (1, 2, 3, None):  # rows at their longest: 12 pages of 4 each
      table = pages.PageTable(4 * shards, page_size=4, prompt_len=6, max_new_tokens=40,
                              shards=shards,
                              capacity=capacity_rows and capacity_rows * 12 * shards)
      trace = schedule.simulate(rng.integers(1, 41, 24), rng.integers(1, 7, 24), table,
                                40, 5)
      preempted += trace.preemptions
  assert preempted and any(checked) and not all(checked)
