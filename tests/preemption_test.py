"""A KV pool smaller than every row at its longest (`rollout.kv_pages`): rows are admitted
while pages are free and the newest are preempted when they run out, then resumed by a
prefill of their prompt and emitted tokens with their own key and step count; every row
ends as the static loop gives it.

The tiny float32 model of continuous_test with its EOS ids (rows end after 1 to 12
tokens), pages of 4 addresses: a prompt bucket of 16 and 12 new tokens take 7 pages a
row, and pools from all 8 rows at their longest (56 pages) down to one row's (7).
"""

import jax
import numpy as np
import pytest

from exgrpo_jax import sampling
from exgrpo_jax.sampling import continuous
from exgrpo_jax.sampling import pages
from exgrpo_jax.sampling import schedule
from tests import continuous_test
from tests.continuous_test import COUNTS, GREEDY, PROMPTS, SAMPLED, assert_same_rows
from tests.continuous_test import eos_model  # pylint: disable=unused-import

PAGE = 4
PER_ROW = 7  # pages of a row at its longest: (16 + 12) / 4


def _engine(cfg, pages, slots=8, tokenizer=None, headroom=0.0):
  return sampling.make_engine("jax", cfg, tokenizer, max_rows=slots,
                              chunk_steps=continuous_test.CHUNK, page_size=PAGE,
                              kv_pages=pages, kv_headroom=headroom)


@pytest.mark.parametrize("config", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_every_pool_size_gives_the_static_rows(eos_model, config):
  cfg, params = eos_model
  key = jax.random.key(3)
  ref = sampling.make_engine("jax", cfg, None, scheduler="static").generate(
      PROMPTS, COUNTS, params, key, config)
  preemptions = {}
  for pages in (8 * PER_ROW, 4 * PER_ROW, 2 * PER_ROW, 10, PER_ROW):
    engine = _engine(cfg, pages)
    assert_same_rows(engine.generate(PROMPTS, COUNTS, params, key, config), ref)
    preemptions[pages] = engine.stats["preemptions"]
    assert (engine.stats["recomputed_tokens"] > 0) == (preemptions[pages] > 0)
  assert preemptions[8 * PER_ROW] == 0
  assert preemptions[10] + preemptions[PER_ROW] > 0, preemptions


def test_a_forced_preemption_of_any_row_at_any_chunk_gives_the_same_rows(eos_model):
  """Every (row, chunk) pair: that row is preempted before that chunk (if it runs then),
  waits first in line and resumes from a prefill of what it had, where it was."""
  cfg, params = eos_model
  key = jax.random.key(5)
  engine = _engine(cfg, None)
  ref = sampling.make_engine("jax", cfg, None, scheduler="static").generate(
      PROMPTS, COUNTS, params, key, SAMPLED)
  prompt_index, rows = ref.prompt_index_N, np.arange(ref.prompt_index_N.size)
  forced = 0
  for row in rows:
    for chunk in range(12):
      def preempt(at, slot_row_B, row=row, chunk=chunk):
        return np.flatnonzero(slot_row_B == row) if at == chunk else []
      before = engine.stats["preemptions"]
      raw = continuous.generate(engine, PROMPTS, prompt_index, rows,
                                continuous.weights(engine, params), key, SAMPLED,
                                prompt_len=16, slots=3, page_size=PAGE, preempt=preempt)
      forced += engine.stats["preemptions"] - before
      np.testing.assert_array_equal(raw["lengths_B"], ref.lengths_N)
      np.testing.assert_array_equal(raw["tokens_BxN"], ref.tokens_NxT)
      np.testing.assert_allclose(raw["logprobs_BxN"], ref.logprobs_NxT, rtol=0, atol=1e-5)
      np.testing.assert_allclose(raw["entropy_BxN"], ref.entropy_NxT, rtol=0, atol=1e-5)
  assert forced >= 2 * rows.size  # every row ran in at least two chunks


@pytest.mark.parametrize("capacity", [None, 2 * PER_ROW, PER_ROW])
def test_the_schedule_simulated_from_the_rows_lengths_is_the_engines(eos_model, capacity):
  """`schedule.simulate`, given only the lengths the rows came out at, runs the chunks,
  slots, pool sizes and preemptions the engine ran (what the AOT planner's estimates
  rest on)."""
  cfg, params = eos_model
  engine = _engine(cfg, capacity)
  prompt_index = np.repeat(np.arange(len(PROMPTS)), COUNTS)
  rows = np.arange(prompt_index.size)
  raw = continuous.generate(engine, PROMPTS, prompt_index, rows,
                            continuous.weights(engine, params), jax.random.key(3), SAMPLED,
                            prompt_len=16, slots=4, page_size=PAGE, capacity=capacity)
  table = pages.PageTable(4, PAGE, 16, SAMPLED.max_new_tokens, 1, capacity)
  trace = schedule.simulate(raw["lengths_B"], [len(PROMPTS[p]) for p in prompt_index], table,
                            SAMPLED.max_new_tokens, continuous_test.CHUNK)
  stats = engine.stats
  assert trace.preemptions == stats["preemptions"]
  assert trace.recomputed_tokens == stats["recomputed_tokens"]
  assert trace.steps_C.sum() == stats["decode_steps"]
  assert (trace.slots_C * trace.steps_C).sum() == stats["slot_steps"]
  np.testing.assert_allclose((trace.pool_pages_C * PAGE * trace.steps_C / trace.slots_C).sum(),
                             stats["attended_slots"], rtol=1e-12)
  assert (trace.preemptions > 0) == (capacity == PER_ROW), trace.preemptions


def test_stop_strings_and_several_eos_ids_under_preemption(text_model):
  cfg, params, tokenizer, prompts, config, ref = continuous_test.stop_string_case(
      text_model, more_eos=True)
  assert len(cfg.eos_token_id) > 1
  per_row = -(-(16 + 16) // PAGE)  # a prompt bucket of 16 and 16 new tokens
  engine = _engine(cfg, per_row, slots=4, tokenizer=tokenizer)
  assert_same_rows(engine.generate(prompts, 3, params, jax.random.key(0), config), ref)
  assert engine.stats["preemptions"] > 0


def test_headroom_admits_fewer_rows_and_preempts_less(eos_model):
  cfg, params = eos_model
  runs = {}
  for headroom in (0.0, 0.2):
    engine = _engine(cfg, 10, headroom=headroom)
    engine.generate(PROMPTS, COUNTS, params, jax.random.key(3), SAMPLED)
    runs[headroom] = engine.stats["preemptions"]
  assert runs[0.2] < runs[0.0], runs


def test_a_pool_below_one_row_per_shard_is_refused(eos_model):
  cfg, params = eos_model
  with pytest.raises(ValueError, match=r"rollout.kv_pages=6: 6 pages per shard of the "
                                       r"rollout's 1, fewer than one row at its longest "
                                       r"\(7 pages of 4 for 16 prompt \+ 12 new tokens\)"):
    _engine(cfg, PER_ROW - 1).generate(PROMPTS, COUNTS, params, jax.random.key(3), SAMPLED)


def test_preemption_takes_the_newest_rows_of_the_shard_that_runs_out():
  # 11 pages a row (32 + 12 addresses), 22 a shard.
  table = pages.PageTable(8, PAGE, 32, 12, shards=2, capacity=44)
  admitted = np.array([1, 2, 3, 0, 4, 7, 5, 0])
  # Shard 0 needs 8 + 8 + 6 = 22 pages, shard 1 11 + 10 = 21: nothing to preempt.
  ends = np.array([32, 32, 24, 0, 44, 40, 0, 0])
  assert schedule._preempted(table, ends, admitted, 2) == []
  # Shard 1 needs 11 + 10 + 11 = 32: its newest row (slot 5, admitted 7th) goes.
  ends[6] = 44
  assert schedule._preempted(table, ends, admitted, 2) == [5]
  ends[2] = 44  # shard 0: 8 + 8 + 11 = 27, its newest is slot 2
  assert schedule._preempted(table, ends, admitted, 2) == [2, 5]
  np.testing.assert_array_equal(ends, [32, 32, 44, 0, 44, 40, 44, 0])  # left as it was
