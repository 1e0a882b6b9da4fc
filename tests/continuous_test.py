"""Continuous batching gives every row exactly what the static loop gives it.

Tiny random models; rows end at different steps (several EOS ids, stop strings), prompts
have different lengths, and slot counts run from 1 to more than the number of rows, with
decode chunks short enough that rows are admitted mid-run and span several chunks.
"""

import dataclasses
import types

import jax
import numpy as np
import pytest

from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax.sampling import continuous
from exgrpo_jax.sampling import decode
from exgrpo_jax.sampling import schedule
from tests import sampler_test

PROMPTS = sampler_test.PROMPTS + [[7], [8, 9, 10, 11, 12, 13]]
COUNTS = [2, 0, 3, 1, 2]  # 8 rows; prompt 1 asks for none
CHUNK = 4
SAMPLED = sampler_test.BASE  # T = 1, entropies
GREEDY = sampler_test.GREEDY


@pytest.fixture(scope="module")
def eos_model():
  """The tiny model with EOS ids that end rows after 1 to 12 tokens."""
  cfg, params = sampler_test.tiny_model()
  free = sampling.make_engine("jax", cfg, None, scheduler="static").generate(
      PROMPTS, COUNTS, params, jax.random.key(3), SAMPLED)
  eos = tuple(sorted({int(t) for t in free.tokens_NxT[[0, 2, 5], [1, 4, 6]]}))
  return dataclasses.replace(cfg, eos_token_id=eos), params


def assert_same_rows(out, ref):
  np.testing.assert_array_equal(out.prompt_index_N, ref.prompt_index_N)
  np.testing.assert_array_equal(out.lengths_N, ref.lengths_N)
  np.testing.assert_array_equal(out.tokens_NxT, ref.tokens_NxT)
  np.testing.assert_array_equal(out.mask_NxT, ref.mask_NxT)
  np.testing.assert_array_equal(out.truncated_N, ref.truncated_N)
  np.testing.assert_allclose(out.logprobs_NxT, ref.logprobs_NxT, rtol=0, atol=1e-5)
  if ref.entropy_NxT is not None:
    np.testing.assert_allclose(out.entropy_NxT, ref.entropy_NxT, rtol=0, atol=1e-5)
  assert out.texts == ref.texts


def _calls(monkeypatch, engine, program, record) -> list:
  """What `record(args, static)` gives for each use of `program` by `engine`, in order."""
  seen, compiled = [], engine.compiled

  def spy(used, args, static, takes_cfg=True):
    if used is program:
      seen.append(record(args, static))
    return compiled(used, args, static, takes_cfg)

  monkeypatch.setattr(engine, "compiled", spy)
  return seen


@pytest.mark.parametrize("config", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_every_slot_count_gives_the_static_rows(eos_model, config):
  cfg, params = eos_model
  key = jax.random.key(3)
  ref = sampling.make_engine("jax", cfg, None, scheduler="static").generate(
      PROMPTS, COUNTS, params, key, config)
  assert len(set(ref.lengths_N.tolist())) >= 2 and ref.lengths_N.min() < sampler_test.MAX_NEW
  for slots in (1, 2, 3, 5, 8, 11):
    engine = sampling.make_engine("jax", cfg, None, max_rows=slots, chunk_steps=CHUNK)
    assert_same_rows(engine.generate(PROMPTS, COUNTS, params, key, config), ref)
    if slots == 1:  # a chunk ends when its only row does: no step is wasted
      assert engine.stats["slot_steps"] == ref.lengths_N.sum()
  # More slots than rows: every row has a slot from the start, and on a rollout this short
  # the engine runs the static loop. The continuous loop itself, with idle slots (more
  # than the engine would give it), gives the same rows too.
  engine = sampling.make_engine("jax", cfg, None, chunk_steps=CHUNK)
  prompt_index = ref.prompt_index_N
  raw = continuous.generate(engine, PROMPTS, prompt_index, np.arange(prompt_index.size),
                            continuous.weights(engine, params), key, config, prompt_len=32,
                            slots=11, page_size=64)
  np.testing.assert_array_equal(raw["lengths_B"], ref.lengths_N)
  np.testing.assert_array_equal(np.where(ref.mask_NxT, raw["tokens_BxN"], 0),
                                np.where(ref.mask_NxT, ref.tokens_NxT, 0))
  np.testing.assert_allclose(raw["logprobs_BxN"], ref.logprobs_NxT, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_the_prefill_on_the_prepared_layers_is_the_models(bias):
  """`continuous.weights` keeps the layers only in the decode form; `decode.prefill` on
  them gives the model's logits and cache (left-padded prompts, with q/k/v bias too)."""
  cfg, _ = sampler_test.tiny_model()
  cfg = dataclasses.replace(cfg, attention_bias=bias)
  params = models.init_params(cfg, jax.random.key(1))
  engine = sampling.make_engine("jax", cfg, None)
  rest, layers = continuous.weights(engine, params)
  assert "layers" not in rest and len(layers) == cfg.num_layers
  prompt_PxL = np.array([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], np.int32)
  valid_PxL = prompt_PxL > 0
  want_logits, want = models.apply(cfg, params, prompt_PxL, valid_PxL,
                                   cache=models.KVCache.zeros(cfg, *prompt_PxL.shape))
  logits, cache = jax.jit(decode.prefill, static_argnums=0)(cfg, rest, prompt_PxL, valid_PxL,
                                                            layers)
  np.testing.assert_allclose(logits, want_logits[:, -1], rtol=0, atol=1e-5)
  for got, ref in zip(jax.tree.leaves(cache), jax.tree.leaves(want)):
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)


def test_long_rollouts_are_scheduled_continuously_when_every_row_has_a_slot(
    eos_model, monkeypatch):
  """From `continuous_from` new tokens on, rows that all have a slot (no max_rows, or
  more slots than rows) go through continuous scheduling too, in the static loop's batch
  of slots (8 for 8 rows, at most max_rows), and keep the static loop's rows; shorter
  rollouts, and the static scheduler, run the static loop."""
  cfg, params = eos_model
  key = jax.random.key(3)
  ref = sampling.make_engine("jax", cfg, None, scheduler="static").generate(
      PROMPTS, COUNTS, params, key, SAMPLED)
  n = sampler_test.MAX_NEW
  for options, slots in ((dict(continuous_from=n), [8]),
                         (dict(continuous_from=n, max_rows=11), [8]),
                         (dict(continuous_from=n, max_rows=8), [8]),
                         (dict(continuous_from=n + 1), []),
                         (dict(), []),  # the default starts far above 12 tokens
                         (dict(continuous_from=None), []),
                         (dict(continuous_from=0, scheduler="static"), [])):
    engine = sampling.make_engine("jax", cfg, None, chunk_steps=CHUNK, **options)
    used = _calls(monkeypatch, engine, continuous.slots_lib.empty,
                  lambda args, static: static["slots"])
    assert_same_rows(engine.generate(PROMPTS, COUNTS, params, key, SAMPLED), ref)
    assert used == slots, options


def test_a_page_pool_that_grows_and_shrinks_gives_the_static_rows(eos_model, monkeypatch):
  """With pages of 4 slots (a prompt bucket of 16 slots and 12 new tokens: 7 pages a
  row, so pool sizes of 7, 14, ... pages), the pool grows as rows advance and shrinks,
  compacting its pages, as they end, mid-run; rows hold only their pages, so a step
  reads fewer slots than the whole cache."""
  cfg, params = eos_model
  key = jax.random.key(3)
  ref = sampling.make_engine("jax", cfg, None, scheduler="static").generate(
      PROMPTS, COUNTS, params, key, SAMPLED)
  for slots in (3, 5):
    engine = sampling.make_engine("jax", cfg, None, max_rows=slots, chunk_steps=CHUNK,
                                  page_size=4)
    first = _calls(monkeypatch, engine, continuous.slots_lib.empty,
                   lambda args, static: static["pages"])
    moves = _calls(monkeypatch, engine, continuous.slots_lib.repage_layer,
                   lambda args, static: args[1].shape[0])
    assert_same_rows(engine.generate(PROMPTS, COUNTS, params, key, SAMPLED), ref)
    sizes = first + moves
    grew, shrank = np.diff(sizes) > 0, np.diff(sizes) < 0
    assert grew.any() and shrank.any(), sizes
    assert engine.stats["attended_slots"] < (16 + 12) * engine.stats["decode_steps"]


def test_a_repage_holds_one_pool_and_one_layer_of_the_other(eos_model, monkeypatch):
  """The pool changes size one layer at a time, and nothing else keeps the old layers:
  after each layer's move the live pool arrays hold at most the larger pool and one
  layer of the other (one program over the whole pool holds both pools to its end)."""
  cfg, params = eos_model
  engine = sampling.make_engine("jax", cfg, None, max_rows=3, chunk_steps=CHUNK,
                                page_size=4)
  K, Dh, L = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
  page_shapes = {(K, Dh, 4), (K, 4, Dh)}  # a k page and a v page
  seen, compiled = [], engine.compiled

  def measured(program, args, static, takes_cfg=True):
    run = compiled(program, args, static, takes_cfg)
    if program is not continuous.slots_lib.repage_layer:
      return run
    sizes = (args[0][0].shape[0], args[1].shape[0])  # old and new pool, in pages

    def run_and_count(layer, source_Q):
      out = jax.block_until_ready(run(layer, source_Q))
      live = sum(x.shape[0] for x in jax.live_arrays() if x.shape[1:] in page_shapes)
      seen.append((live // 2, *sizes))  # layer-pages: a k and a v array each
      return out
    return run_and_count

  monkeypatch.setattr(engine, "compiled", measured)
  ref = sampling.make_engine("jax", cfg, None, scheduler="static").generate(
      PROMPTS, COUNTS, params, jax.random.key(3), SAMPLED)
  assert_same_rows(engine.generate(PROMPTS, COUNTS, params, jax.random.key(3), SAMPLED), ref)
  assert {old < new for _, old, new in seen} == {True, False}, seen  # grew and shrank
  for live, old, new in seen:
    assert live <= L * max(old, new) + min(old, new), (live, old, new)


def test_the_tail_runs_in_fewer_slots(eos_model, monkeypatch):
  """Once no row waits, the live rows move into half the slots or fewer (a power of two),
  as often as their count allows; the rows stay the static loop's."""
  cfg, params = eos_model
  key = jax.random.key(3)
  ref = sampling.make_engine("jax", cfg, None, scheduler="static").generate(
      PROMPTS, COUNTS, params, key, SAMPLED)
  for slots in (4, 5):
    engine = sampling.make_engine("jax", cfg, None, max_rows=slots, chunk_steps=CHUNK)
    kept = _calls(monkeypatch, engine, continuous.slots_lib.select,
                  lambda args, static: args[1].shape[0])
    assert_same_rows(engine.generate(PROMPTS, COUNTS, params, key, SAMPLED), ref)
    assert kept and kept == sorted(kept, reverse=True) and kept[-1] == 1, kept
    assert all(2 * c <= b for b, c in zip([slots] + kept, kept)), kept
    assert engine.stats["slot_steps"] < slots * engine.stats["decode_steps"]


def test_on_a_mesh_new_rows_fill_the_emptiest_shard_and_the_tail_keeps_each_rows_shard():
  """8 slots in 2 shards. Free slots are taken from the shard with the fewest rows (the
  pool is sized by its fullest shard); the tail keeps every row in its own shard, so its
  pages stay on its device, with as many slots per shard as the fullest needs."""
  slot_row_B = np.array([0, 1, 2, -1, -1, -1, -1, -1])
  np.testing.assert_array_equal(schedule._free_slots(slot_row_B, 2), [4, 5, 6, 3, 7])
  np.testing.assert_array_equal(schedule._free_slots(slot_row_B, 1), [3, 4, 5, 6, 7])
  tail_B = np.array([-1, 7, -1, -1, 8, -1, 9, -1])
  np.testing.assert_array_equal(schedule._tail_slots(tail_B, 2), [1, 0, 4, 6])
  np.testing.assert_array_equal(schedule._tail_slots(tail_B, 1), [1, 4, 6, 0])
  assert schedule._tail_slots(np.array([-1, 7, 8, 9, -1, -1, -1, -1]), 2) is None


def test_on_a_mesh_the_slots_are_a_multiple_of_the_batch_shards(eos_model):
  cfg, _ = eos_model
  engine = sampling.make_engine("jax", cfg, None, max_rows=3)
  mesh = types.SimpleNamespace(shape={"fsdp": 4, "tensor": 2})
  assert engine.continuous_slots(12, 40) == 3
  assert engine.continuous_slots(12, 40, mesh) == 4
  assert engine.continuous_slots(2, 40) == 0  # every row has a slot: the static loop
  assert sampling.make_engine("jax", cfg, None, continuous_from=0).continuous_slots(
      3, 40, mesh) == 4


def test_rows_keep_their_draws_whatever_their_slot(eos_model):
  """Row r's draws come from fold_in(fold_in(key, r), t): dropping the rows before it
  (so it gets another slot at another time) leaves it as it was."""
  cfg, params = eos_model
  engine = sampling.make_engine("jax", cfg, None, max_rows=2, chunk_steps=CHUNK)
  whole = engine.generate(PROMPTS, COUNTS, params, jax.random.key(4), SAMPLED)
  tail = engine.generate(PROMPTS, [0, 0, 0, 1, 2], params, jax.random.key(4), SAMPLED)
  # Without the rows before it, row 5 is row 0: it draws with fold_in(key, 0), not 5.
  assert (tail.tokens_NxT != whole.tokens_NxT[5:]).any()
  shifted = engine.generate(PROMPTS, [0, 5, 0, 1, 2], params, jax.random.key(4), SAMPLED)
  np.testing.assert_array_equal(shifted.tokens_NxT[5:], whole.tokens_NxT[5:])
  np.testing.assert_allclose(shifted.logprobs_NxT[5:], whole.logprobs_NxT[5:], atol=1e-5)


def test_prompts_are_prefilled_once_and_programs_compiled_once(eos_model):
  """A prompt's rows share its prefill even when they enter in different refills (3
  slots, groups of 2 and 3 rows). The programs: prepare, empty, decode, place, and an
  admit per count of new prompts (0, 1, 2, 4); new weights, keys or sampling switches
  compile none."""
  cfg, params = eos_model
  engine = sampling.make_engine("jax", cfg, None, max_rows=3, chunk_steps=CHUNK)
  for counts, prompts_used in (([2, 0, 3, 1, 2], 4), ([3, 0, 1, 2, 3], 4), ([1, 0, 1, 0, 8], 3)):
    before = engine.stats["prefills"]
    engine.generate(PROMPTS, counts, params, jax.random.key(0), SAMPLED)
    assert engine.stats["prefills"] - before == prompts_used
  compiles = engine.stats["compiles"]
  shifted = jax.tree.map(lambda x: x * 1.01, params)
  for counts in ([2, 0, 3, 1, 2], [3, 0, 1, 2, 3], [1, 0, 1, 0, 8]):
    engine.generate(PROMPTS, counts, shifted, jax.random.key(1), GREEDY)
  assert engine.stats["compiles"] == compiles


def stop_string_case(text_model, more_eos: bool = False):
  """Two prompts x 3 rows of 16 new tokens at most, with stop strings taken from the
  middle of two rows' texts, so those rows stop early, and with `more_eos` a second EOS
  id, a third row's token: (cfg, params, tokenizer, prompts, config, the static rows)."""
  cfg, params, tokenizer = text_model
  prompts = [tokenizer("Hi there")["input_ids"], tokenizer("What is 2 + 2? Think.")["input_ids"]]
  config = dataclasses.replace(SAMPLED, max_new_tokens=16)
  free = sampling.make_engine("jax", cfg, tokenizer, scheduler="static").generate(
      prompts, 3, params, jax.random.key(0), config)
  stops = tuple(text[len(text) // 2:len(text) // 2 + 2] for text in free.texts[1:5:3])
  if more_eos:
    cfg = dataclasses.replace(cfg, eos_token_id=tuple(sorted(
        {*cfg.eos_token_id, int(free.tokens_NxT[2, 6])})))
  config = dataclasses.replace(config, stop_strings=stops)
  ref = sampling.make_engine("jax", cfg, tokenizer, scheduler="static").generate(
      prompts, 3, params, jax.random.key(0), config)
  assert (ref.lengths_N < free.lengths_N).sum() >= 2
  return cfg, params, tokenizer, prompts, config, ref


def test_stop_strings_end_rows_as_in_the_static_loop(text_model):
  cfg, params, tokenizer, prompts, config, ref = stop_string_case(text_model)
  for slots in (1, 4):
    engine = sampling.make_engine("jax", cfg, tokenizer, max_rows=slots, chunk_steps=CHUNK)
    assert_same_rows(engine.generate(prompts, 3, params, jax.random.key(0), config), ref)


def test_bad_scheduler_is_named():
  cfg, _ = sampler_test.tiny_model()
  with pytest.raises(ValueError, match="scheduler must be one of continuous, static, got 'fifo'"):
    sampling.make_engine("jax", cfg, None, scheduler="fifo")
  with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
    sampling.make_engine("jax", cfg, None, page_size=0)
  with pytest.raises(ValueError, match="continuous_from must be None or >= 0, got -1"):
    sampling.make_engine("jax", cfg, None, continuous_from=-1)
