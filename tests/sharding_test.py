"""Sharded training and sampling on 8 fake CPU devices agree with one device.

The device count is fixed when JAX starts, and the other tests expect one device, so
the sharded runs happen in a child process (`_child`, with
`--xla_force_host_platform_device_count=8`); it saves what it measured (losses,
parameters, shardings, compile counts, sampled tokens) and the tests here assert on it.
The one-device reference runs in the same child, on one of its devices.
"""

import json
import os
import sys

import numpy as np
import pytest

from tests import conftest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = {"8x1": (8, 1), "4x2": (4, 2), "2x4": (2, 4)}
SAMPLING_MESHES = ("8x1", "2x4")  # a replicated and a tensor-parallel rollout copy
STEPS = 3
LARGE = 1024  # elements; every parameter and moment at least this big must be split


def _child(outdir: str) -> None:
  """Runs in the 8-device process: one-device reference, then every mesh."""
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import models, sampling, sharding  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.sampling import slots as slots_lib  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.training import learner  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.training import packing  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, REPO)
  from configs import common  # pylint: disable=g-import-not-at-top

  assert jax.device_count() == 8, jax.devices()
  cfg = models.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                           eos_token_id=(1,))
  optim = ml_collections.ConfigDict(dict(lr=1e-4, weight_decay=0.01, b1=0.9, b2=0.999,
                                         eps=1e-8, grad_clip=1.0, skip_grad_norm=500.0))
  algo = common.base_config().algo
  algo.norm_len = 16
  static = dict(cfg=cfg, algo=learner.frozen(algo), optim=learner.frozen(optim),
                use_clip=True, chunk=8)
  tx = learner.make_optimizer(optim)
  rng = np.random.default_rng(0)
  M, B, P, R = 2, 8, 8, 16
  batches = []
  for _ in range(STEPS):  # packed rows; the second micro-batch may be left empty
    responses = [packing.Sequence(
        rng.integers(2, 128, rng.integers(1, P + 1)), rng.integers(2, 128, rng.integers(1, R)),
        rng.normal(-3, 0.5, R), rng.normal(), rng.random() < 0.5) for _ in range(M * B)]
    batches.append(packing.train_batch(
        responses, prompt_len=P, response_len=R, micro_batch=B, num_micro=M, pad_id=0,
        aggregation=algo.aggregation, norm_len=algo.norm_len))
  # Larger weights than init's 0.02 give a peaked, prompt-dependent next-token
  # distribution, so greedy decoding is a sharp test.
  sample_params = jax.tree.map(lambda x: x * 20, models.init_params(cfg, jax.random.key(1)))
  prompts = [list(rng.integers(2, 128, n)) for n in (5, 9, 3, 7)]
  greedy = sampling.SamplingConfig(greedy=True, max_new_tokens=12)
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, *a, **k: compiles.append(event)
      if event == "/jax/core/compile/backend_compile_duration" else None)

  def train(params, opt_state):
    losses, compiles_after_first = [], 0
    for i, batch in enumerate(batches):
      before = len(compiles)
      params, opt_state, metrics = learner.train_step(params, opt_state, batch, **static)
      losses.append(float(metrics["loss"]))
      compiles_after_first += (len(compiles) - before) * (i > 0)
    rows = batches[0]
    tokens = np.asarray(learner.score_responses(cfg, params, rows.tokens_MxBxT[0],
                                                rows.segment_ids_MxBxT[0],
                                                rows.index_MxBxR[0], 8)[0])
    return params, opt_state, dict(losses=losses, compiles_after_first=compiles_after_first,
                                   score=tokens.tolist())

  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = jax.device_put(models.init_params(cfg, jax.random.key(0)), one)
  params, _, results = train(params, jax.device_put(tx.init(params), one))
  out = sampling.make_engine("jax", cfg, None).generate(
      prompts, 3, jax.device_put(sample_params, one), jax.random.key(2), greedy)
  summary = {"single": dict(results, greedy=out.tokens_NxT.tolist(),
                            greedy_logp=out.logprobs_NxT.tolist())}
  np.savez(os.path.join(outdir, "single.npz"), *map(np.asarray, jax.tree.leaves(params)))

  for name, shape in MESHES.items():
    mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(shape=shape,
                                                             axes=("fsdp", "tensor"))))
    param_shardings = models.param_shardings(cfg, mesh)
    params = models.init_params(cfg, jax.random.key(0), param_shardings)
    opt_state = sharding.init_optimizer(
        tx, params, sharding.optimizer_shardings(tx, models.abstract_params(cfg), param_shardings))
    split_at_start = _unsplit_large_leaves(params, opt_state)
    params, opt_state, results = train(params, opt_state)
    summary[name] = dict(
        results, unsplit_at_start=split_at_start,
        unsplit_after_steps=_unsplit_large_leaves(params, opt_state),
        param_bytes_per_device=sharding.bytes_per_device(params),
        param_bytes=sum(x.nbytes for x in jax.tree.leaves(params)))
    # The continuous-batching pool: by page over the batch axes, by KV head over tensor.
    pool = slots_lib.empty.lower(
        cfg, jax.device_put(sample_params, param_shardings), jax.random.key(0), slots=8,
        pages=16, page_size=4, prompt_len=8, mesh=mesh).compile().output_shardings[0]
    summary[name]["pool_specs"] = [list(s.spec) + [None] * (4 - len(s.spec))
                                   for s in pool.caches[0]]
    summary[name]["repage"] = _repage_on(mesh)
    if name in SAMPLING_MESHES:  # with a phased cache (long rollouts), against 1 phase
      out = sampling.make_engine("jax", cfg, None, cache_phases=3).generate(
          prompts, 3, jax.device_put(sample_params, param_shardings), jax.random.key(2),
          greedy)
      summary[name].update(greedy=out.tokens_NxT.tolist(),
                           greedy_logp=out.logprobs_NxT.tolist())
      # Continuous batching: the 12 rows through 8 slots, sharded over the batch axes, in a
      # pool of 4-slot pages that grows; the last 4 rows run in 4 slots where the batch
      # axes (2 ways on 2x4) divide them.
      engine = sampling.make_engine("jax", cfg, None, max_rows=8, chunk_steps=4,
                                    page_size=4)
      stacked_alive = _stacked_layers_alive(engine)
      out = engine.generate(prompts, 3, jax.device_put(sample_params, param_shardings),
                            jax.random.key(2), greedy)
      summary[name].update(continuous=out.tokens_NxT.tolist(),
                           continuous_logp=out.logprobs_NxT.tolist(),
                           tail_slot_steps=engine.stats["slot_steps"]
                           - 8 * engine.stats["decode_steps"],
                           stacked_layers_alive=stacked_alive)
      # 3 slots asked for, fewer than or not a multiple of the batch shards (8, 2): the
      # engine rounds them up (a bare StopIteration before).
      out = sampling.make_engine("jax", cfg, None, max_rows=3, chunk_steps=4,
                                 page_size=4).generate(
          prompts, 3, jax.device_put(sample_params, param_shardings), jax.random.key(2),
          greedy)
      summary[name].update(continuous_3_slots=out.tokens_NxT.tolist(),
                           continuous_3_slots_logp=out.logprobs_NxT.tolist())
      summary[name].update(_preempting(cfg, jax.device_put(sample_params, param_shardings),
                                       prompts, greedy, mesh))
    np.savez(os.path.join(outdir, f"{name}.npz"), *map(np.asarray, jax.tree.leaves(params)))
  with open(os.path.join(outdir, "summary.json"), "w") as f:
    json.dump(summary, f)


def _stacked_layers_alive(engine) -> list:
  """Spies on `engine`: before each decode chunk, how many arrays of the rollout copy's
  stacked layers are still alive (by buffer address and shape)."""
  import jax  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.sampling import slots as slots_lib  # pylint: disable=g-import-not-at-top
  buffer = lambda x: (x.shape, x.addressable_shards[0].data.unsafe_buffer_pointer())
  stacked, alive = set(), []
  make_copy, compiled = engine._rollout_params, engine.compiled

  def rollout_params(params):
    copy = make_copy(params)
    stacked.update(map(buffer, jax.tree.leaves(copy["layers"])))
    return copy

  def spy(program, args, static, takes_cfg=True):
    if program is slots_lib.decode_chunk:
      alive.append(len(stacked & set(map(buffer, jax.live_arrays()))))
    return compiled(program, args, static, takes_cfg)

  engine._rollout_params, engine.compiled = rollout_params, spy
  return alive


def _preempting(cfg, params, prompts, greedy, mesh) -> dict:
  """The rows through a pool of one row at its longest per shard (7 pages of 4 for 16
  prompt + 12 new addresses) and two slots a shard, so rows are preempted: their tokens,
  the preemptions, and how many pages a live row held outside its slot's shard."""
  import jax  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import sampling  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import sharding  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.sampling import pages  # pylint: disable=g-import-not-at-top
  shards = sharding.batch_shards(mesh)
  engine = sampling.make_engine("jax", cfg, None, max_rows=2 * shards, chunk_steps=4,
                                page_size=4, kv_pages=7 * shards)
  outside, fit = [], pages.PageTable.fit

  def checked_fit(table, ends_B):
    source_Q = fit(table, ends_B)
    per_slot, per_page = table.slots // table.shards, table.pages // table.shards
    for b, row in enumerate(table.table_BxN):
      held = row[row >= 0]
      outside.extend(held[held // per_page != b // per_slot].tolist())
    return source_Q

  pages.PageTable.fit = checked_fit
  try:
    out = engine.generate(prompts, 3, params, jax.random.key(2), greedy)
  finally:
    pages.PageTable.fit = fit
  return dict(preempted=out.tokens_NxT.tolist(), preempted_logp=out.logprobs_NxT.tolist(),
              preemptions=engine.stats["preemptions"], pages_outside_shard=len(outside))


def _repage_on(mesh) -> dict:
  """A pool layer grown from 16 to 24 pages on `mesh`, each new page's source in its own
  shard's part of the pool (as `pages.PageTable` gives): whether the moved pages are the
  old ones and new pages zeros, and the collectives in the compiled program."""
  import re  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import sharding  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.sampling import slots as slots_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(3)
  old, new, shards = 16, 24, sharding.batch_shards(mesh)
  source_Q = np.full(new, old, np.int32)
  for s in range(shards):
    mine = rng.permutation(np.arange(s * old // shards, (s + 1) * old // shards))
    kept = mine[:rng.integers(1, mine.size + 1)]
    source_Q[s * new // shards:s * new // shards + kept.size] = kept
  layer = (rng.standard_normal((old, 2, 8, 4)), rng.standard_normal((old, 2, 4, 8)))
  specs = tuple(sharding.spec(("batch", "kv_heads", None, None), x.shape, mesh)
                for x in layer)
  placed = tuple(jax.device_put(np.float32(x), sharding.NamedSharding(mesh, s))
                 for x, s in zip(layer, specs))
  source = jax.device_put(source_Q, sharding.replicated(mesh))
  with sharding.use_mesh(mesh):
    compiled = slots_lib.repage_layer.lower(placed, source, mesh=mesh).compile()
    moved = compiled(placed, source)
  kept = source_Q < old
  moved_right = all(np.array_equal(np.asarray(y)[kept], np.float32(x)[source_Q[kept]])
                    and not np.asarray(y)[~kept].any() for x, y in zip(layer, moved))
  return dict(moved=moved_right, collectives=sorted(set(re.findall(
      r"all-gather|all-to-all|collective-permute|all-reduce", compiled.as_text()))))


def _unsplit_large_leaves(params, opt_state) -> list[str]:
  """Paths of large leaves that are whole on some device, or not on all 8 devices."""
  import jax  # pylint: disable=g-import-not-at-top
  bad = []
  for path, x in jax.tree_util.tree_leaves_with_path((params, opt_state)):
    if x.size >= LARGE and (x.sharding.is_fully_replicated or len(x.sharding.device_set) != 8
                            or x.addressable_shards[0].data.size == x.size):
      bad.append(jax.tree_util.keystr(path))
  return bad


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
  outdir = tmp_path_factory.mktemp("sharded")
  conftest.run_on_cpu_devices(
      f"from tests import sharding_test; sharding_test._child({str(outdir)!r})", 8)
  with open(outdir / "summary.json") as f:
    summary = json.load(f)
  arrays = {name: list(np.load(outdir / f"{name}.npz").values())
            for name in ["single", *MESHES]}
  return summary, arrays


@pytest.mark.parametrize("mesh", MESHES)
def test_train_step_matches_one_device(measured, mesh):
  summary, arrays = measured
  np.testing.assert_allclose(summary[mesh]["losses"], summary["single"]["losses"],
                             rtol=1e-5, atol=1e-5)
  assert len(arrays[mesh]) == len(arrays["single"])
  for sharded, single in zip(arrays[mesh], arrays["single"]):
    np.testing.assert_allclose(sharded, single, rtol=0, atol=1e-5)
  np.testing.assert_allclose(summary[mesh]["score"], summary["single"]["score"], atol=1e-5)


@pytest.mark.parametrize("mesh", MESHES)
def test_large_params_and_optimizer_state_are_split(measured, mesh):
  summary, _ = measured
  assert summary[mesh]["unsplit_at_start"] == []
  assert summary[mesh]["unsplit_after_steps"] == []
  # All but the small norm scales is split: well under 1/4 of the bytes per device.
  assert summary[mesh]["param_bytes_per_device"] < summary[mesh]["param_bytes"] / 4


@pytest.mark.parametrize("mesh", MESHES)
def test_train_step_compiles_once(measured, mesh):
  summary, _ = measured
  assert summary[mesh]["compiles_after_first"] == 0
  assert summary["single"]["compiles_after_first"] == 0


@pytest.mark.parametrize("mesh", SAMPLING_MESHES)
def test_sharded_greedy_sampling_matches_one_device(measured, mesh):
  summary, _ = measured
  tokens = np.array(summary["single"]["greedy"])
  assert len(np.unique(tokens)) > 4  # a real test: the outputs are not constant
  # Fewer slot-steps than 8 per step: the tail ran in fewer slots (not on 8x1, where the
  # slots must stay 8-way split).
  assert (summary[mesh]["tail_slot_steps"] < 0) == (mesh == "2x4")
  for name in ("greedy", "continuous", "continuous_3_slots", "preempted"):
    np.testing.assert_array_equal(summary[mesh][name], tokens)
    np.testing.assert_allclose(summary[mesh][name + "_logp"], summary["single"]["greedy_logp"],
                               atol=1e-4)


@pytest.mark.parametrize("mesh", SAMPLING_MESHES)
def test_the_rollout_copys_stacked_layers_are_freed_before_decoding(measured, mesh):
  """The continuous engine keeps the layers once, prepared (`continuous.weights`): the
  rollout copy's stacked layers are gone by the first decode chunk."""
  summary, _ = measured
  alive = summary[mesh]["stacked_layers_alive"]
  assert alive and not any(alive), alive


@pytest.mark.parametrize("mesh", SAMPLING_MESHES)
def test_preempted_rows_keep_their_pages_in_their_shard(measured, mesh):
  """A pool of one row per shard, two slots a shard: rows are preempted and resumed (the
  rows equal one device's, above), and a running row's pages never leave its shard."""
  summary, _ = measured
  assert summary[mesh]["preemptions"] > 0
  assert summary[mesh]["pages_outside_shard"] == 0


@pytest.mark.parametrize("mesh", MESHES)
def test_a_pool_resize_moves_each_devices_pages_on_that_device(measured, mesh):
  """`slots.repage_layer` on a mesh: the old pages in their new places (zeros for new
  pages), with no collective: XLA's own gather over a pool split by
  page went through the other devices' pages (on TPU, a temporary of 4.5 to 9.75 times
  the new layer)."""
  summary, _ = measured
  assert summary[mesh]["repage"] == dict(moved=True, collectives=[])


@pytest.mark.parametrize("mesh", MESHES)
def test_page_pool_is_split_by_page_and_kv_head(measured, mesh):
  summary, _ = measured
  # 2 KV heads: split by tensor = 2 (4x2), whole under tensor = 4 (2x4) or 1.
  kv = "tensor" if mesh == "4x2" else None
  assert summary[mesh]["pool_specs"] == [["fsdp", kv, None, None]] * 2
