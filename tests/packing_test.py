"""Packed rows: placement within the budgets, what the model sees, and packed == padded
teacher-forced scores (the learner's packed == padded gradients are in learner_test)."""

import jax
import numpy as np
import pytest

from exgrpo_jax import models
from exgrpo_jax.training import experience
from exgrpo_jax.training import packing

P, R = 8, 12


def _sequences(seed, n):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(2, 96, int(rng.integers(1, P + 3))) for _ in range(n)]
  responses = [rng.integers(2, 96, int(rng.integers(1, R + 3))) for _ in range(n)]
  return prompts, responses


@pytest.mark.parametrize("pack", [True, False])
def test_rows_hold_each_sequence_once_within_the_budgets(pack):
  prompts, responses = _sequences(0, 40)
  layout = packing.place([len(p) for p in prompts], [len(r) for r in responses], P, R, pack)
  rows = packing.rows(layout, prompts, responses, layout.num_rows + 2, pad_id=0)
  assert layout.num_rows == (len(prompts) if not pack else layout.num_rows)
  if pack:  # first fit: no two rows both at most half full in tokens and in slots
    tokens_N = (rows.segment_ids_NxT != 0).sum(1)[:layout.num_rows]
    slots_N = rows.mask_NxR.sum(1)[:layout.num_rows]
    assert ((tokens_N <= (P + R) / 2) & (slots_N <= R / 2)).sum() <= 1
    assert layout.num_rows < 0.8 * len(prompts)
  assert not rows.segment_ids_NxT[layout.num_rows:].any()
  assert rows.mask_NxR.sum(1).max() <= R
  for s, (prompt, response) in enumerate(zip(prompts, responses)):
    row, column, n = layout.row_S[s], layout.column_S[s], layout.length_S[s]
    p = prompt[-P:]
    segment = rows.segment_ids_NxT[row, column - 1]
    # The sequence is one contiguous segment: its kept prompt then its kept response.
    np.testing.assert_array_equal(np.flatnonzero(rows.segment_ids_NxT[row] == segment),
                                  np.arange(column - len(p), column + n))
    np.testing.assert_array_equal(rows.tokens_NxT[row, column - len(p):column + n],
                                  np.concatenate([p, response[:R]]))
    # Its slots score its response tokens from the positions just before them.
    slots = slice(layout.slot_S[s], layout.slot_S[s] + n)
    assert rows.mask_NxR[row, slots].all()
    np.testing.assert_array_equal(rows.tokens_NxT[row, rows.index_NxR[row, slots] + 1],
                                  response[:R])


def test_slots_round_trip():
  prompts, responses = _sequences(1, 10)
  layout = packing.place([len(p) for p in prompts], [len(r) for r in responses], P, R)
  per_token = [np.arange(len(r), dtype=np.float32) + 100 * s for s, r in enumerate(responses)]
  back = packing.from_slots(layout, packing.to_slots(layout, per_token, layout.num_rows,
                                                     np.float32))
  for s, values in enumerate(per_token):
    np.testing.assert_array_equal(back[s, :layout.length_S[s]], values[:R])
    assert not back[s, layout.length_S[s]:].any()
  scalars = packing.to_slots(layout, np.arange(10.0) + 1, layout.num_rows, np.float32)
  np.testing.assert_array_equal(packing.from_slots(layout, scalars)[:, 0], np.arange(10) + 1)


def test_empty_prompt_is_rejected():
  with pytest.raises(ValueError, match="sequence 1 has an empty prompt"):
    packing.place([3, 0], [2, 2], P, R)


def test_packed_scores_match_padded():
  cfg = models.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
  params = models.init_params(cfg, jax.random.key(0))
  prompts, responses = _sequences(2, 7)
  rows = [(p, r, None) for p, r in zip(prompts, responses)]
  score = lambda pack: experience.score_rows(rows, cfg=cfg, params=params, max_new_tokens=R,
                                             batch_size=4, pad_id=0, chunk=5, pack=pack)
  packed, padded = score(True), score(False)
  np.testing.assert_array_equal(packed.mask_SxR, padded.mask_SxR)
  np.testing.assert_allclose(packed.logp_SxR, padded.logp_SxR, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed.entropy_SxR, padded.entropy_SxR, rtol=1e-5, atol=1e-5)
