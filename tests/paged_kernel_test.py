"""The TPU decode path (pool in the ragged paged-attention kernel's layout, the kernel on
each row's pages) gives the rows the XLA path gives them.

On CPU the kernel is the Mosaic kernel itself (`paged_kernel` calls
`jax.experimental.pallas.ops.tpu.ragged_paged_attention`), run by Pallas's TPU
interpreter (`pltpu.force_tpu_interpret_mode`, which emulates its DMAs and semaphores)
with two of the interpreter's gaps filled (`_fill_interpreter_gaps`); its arithmetic is
the kernel's own (online softmax over blocks of pages, its masks).
`tests/aot_test.py` compiles the same kernel for a TPU mesh.
"""

import dataclasses
import json
import os
import types

import jax
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter
from jax._src.pallas.mosaic.interpret import utils as interpreter_utils
from jax._src.state import types as state_types
from jax.experimental.pallas import tpu as pltpu

from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax import sharding
from exgrpo_jax.sampling import paged_kernel
from exgrpo_jax.sampling import slots as slots_lib
from tests import conftest

# Prompts of 1 to 19 tokens; 9 rows through 3 slots in chunks of 4 steps: rows end at
# different steps (EOS) and are admitted mid-run, beside rows of other lengths.
PROMPTS = [[5, 6, 7], list(range(20, 39)), [3, 9, 4, 11, 2, 8, 30, 31, 40], [7], [8, 9]]
COUNTS = [2, 3, 1, 2, 1]
GREEDY = sampling.SamplingConfig(max_new_tokens=24, greedy=True, return_entropy=True)


def _fill_interpreter_gaps(monkeypatch):
  """Two loads and stores the kernel makes that Pallas's TPU interpreter (jax 0.10.2 and
  0.12) gets wrong, done by hand: a load through a reshaped VMEM buffer (the kernel
  reshapes its double buffer of pages and loads keys and values at a stride; the
  interpreter maps every ref transform to a slice: "'ReshapeTransform' object has no
  attribute 'indices'"), and a masked store into part of a buffer (its bounds check marks
  out of bounds along the first axis whatever axis it checks: "Out-of-bounds masked swap
  ... swapping [(slice(0, 3, 1), slice(0, 2, 1), slice(0, 128, 1))] but buffer has shape
  (3, 4, 128)")."""
  get, swap = interpreter.get.__wrapped__, interpreter.swap.__wrapped__

  def reshaped_get(token, device_id, core_id, memory_space, buffer_id, transforms, *args,
                   **kwargs):
    reshapes = [isinstance(t, state_types.ReshapeTransform) for t in transforms]
    if not any(reshapes):
      return get(token, device_id, core_id, memory_space, buffer_id, transforms, *args,
                 **kwargs)
    i = reshapes.index(True)
    token, value = get(token, device_id, core_id, memory_space, buffer_id, transforms[:i],
                       *args, **kwargs)
    value = value.reshape(transforms[i].shape)
    for indexer in jax.tree.map(int, transforms[i + 1:]):
      value = value[tuple(map(interpreter_utils._transform_slice_or_index,  # pylint: disable=protected-access
                              indexer.indices))]
    return token, value

  def masked_swap(token, device_id, core_id, memory_space, buffer_id, transforms, value,
                  mask, **kwargs):
    if mask is None:
      return swap(token, device_id, core_id, memory_space, buffer_id, transforms, value,
                  mask, **kwargs)
    mask = np.asarray(mask)
    token, old = get(token, device_id, core_id, memory_space, buffer_id, transforms)
    token, _ = swap(token, device_id, core_id, memory_space, buffer_id, transforms,
                    np.where(mask, value, old), None, **kwargs)
    return token, np.where(mask, old, value)

  monkeypatch.setattr(interpreter, "get", interpreter.fail_on_exception(reshaped_get))
  monkeypatch.setattr(interpreter, "swap", interpreter.fail_on_exception(masked_swap))


def _qwen2_model():
  """A tiny Qwen2-shaped model (GQA: 4 query heads on 2 KV heads, q/k/v biases; heads of
  128, the kernel's lane width) with EOS ids that end rows early."""
  cfg = models.ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=64,
                           intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=128, attention_bias=True, tie_word_embeddings=False,
                           eos_token_id=(1,), pad_token_id=0)
  params = models.init_params(cfg, jax.random.key(0))
  params["lm_head"] = params["lm_head"] * 10
  free = sampling.make_engine("jax", cfg, None, scheduler="static").generate(
      PROMPTS, COUNTS, params, jax.random.key(1), GREEDY)
  eos = tuple(sorted({int(t) for t in free.tokens_NxT[[0, 3, 6], [2, 5, 9]]}))
  return dataclasses.replace(cfg, eos_token_id=eos), params


@pytest.fixture(scope="module")
def qwen2_model():
  return _qwen2_model()


def _generate(cfg, params, monkeypatch, kernel: bool, slots: int = 3, **options):
  engine = sampling.make_engine("jax", cfg, None, max_rows=slots, chunk_steps=4, page_size=4,
                                **options)
  layouts, grown = [], []
  empty = engine.compiled

  def spy(program, args, static, takes_cfg=True):
    if program is slots_lib.empty:
      layouts.append(static["kernel"])
    if program is slots_lib.repage_layer:
      grown.append(args[1].shape[0] > args[0][0].shape[0])
    return empty(program, args, static, takes_cfg)

  monkeypatch.setattr(engine, "compiled", spy)
  monkeypatch.setattr(paged_kernel, "wanted", lambda *_: kernel)
  # Blocks of 2 pages and 2 queries: rows span several of each, as on a TPU (1024 keys
  # and 32 queries a block there).
  monkeypatch.setattr(paged_kernel, "_BLOCK_KEYS", 8)
  monkeypatch.setattr(paged_kernel, "_BLOCK_QUERIES", 2)
  _fill_interpreter_gaps(monkeypatch)
  with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
    out = engine.generate(PROMPTS, COUNTS, params, jax.random.key(1), GREEDY)
  # The kernel's pool, and one of one row's pages (kv_pages), has one size: it never grows.
  assert layouts == [kernel] and any(grown) == (not kernel and "kv_pages" not in options)
  return out, engine.stats


def _assert_same_rows(out, ref):
  np.testing.assert_array_equal(out.lengths_N, ref.lengths_N)
  np.testing.assert_array_equal(out.tokens_NxT, ref.tokens_NxT)
  np.testing.assert_allclose(out.logprobs_NxT, ref.logprobs_NxT, rtol=0, atol=1e-5)
  np.testing.assert_allclose(out.entropy_NxT, ref.entropy_NxT, rtol=0, atol=1e-5)


def test_kernel_path_gives_the_xla_paths_rows(qwen2_model, monkeypatch):
  cfg, params = qwen2_model
  ref, ref_stats = _generate(cfg, params, monkeypatch, kernel=False)
  out, stats = _generate(cfg, params, monkeypatch, kernel=True)
  assert len(set(ref.lengths_N)) > 2 and stats["prefills"] == ref_stats["prefills"]
  _assert_same_rows(out, ref)


@pytest.mark.slow  # by default: the kernel path above, the preemptions in preemption_test
def test_kernel_path_with_preempted_rows_gives_the_xla_paths_rows(qwen2_model, monkeypatch):
  """A pool of one row at its longest (pages of 4 for a prompt bucket of 32 and 24 new
  tokens: 14) beside 3 slots, every row running to its longest: rows are preempted, and
  resume into the kernel's layout."""
  cfg, params = qwen2_model
  ref, _ = _generate(cfg, params, monkeypatch, kernel=False, ignore_eos=True)
  out, stats = _generate(cfg, params, monkeypatch, kernel=True, ignore_eos=True, kv_pages=14)
  assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0
  _assert_same_rows(out, ref)


def _mesh_child(outdir: str) -> None:
  """On a 2 x 2 mesh of CPU devices: 4 slots, rows and pages split in 2, KV heads in 2;
  the tail keeps each row in its half, with its pages."""
  monkeypatch = pytest.MonkeyPatch()
  cfg, params = _qwen2_model()
  mesh = sharding.make_mesh(types.SimpleNamespace(shape=(2, 2), axes=("fsdp", "tensor")))
  params = jax.device_put(params, models.param_shardings(cfg, mesh))
  rows = {}
  for kernel in (False, True):
    out, stats = _generate(cfg, params, monkeypatch, kernel=kernel, slots=4)
    rows[kernel] = dict(lengths=out.lengths_N.tolist(), tokens=out.tokens_NxT.tolist(),
                        logprobs=out.logprobs_NxT.tolist(), entropy=out.entropy_NxT.tolist())
  with open(os.path.join(outdir, "rows.json"), "w", encoding="utf-8") as f:
    json.dump({str(k): v for k, v in rows.items()}, f)


@pytest.mark.slow
def test_kernel_path_on_a_mesh_gives_the_xla_paths_rows(tmp_path):
  rows = conftest.run_on_cpu_devices(
      f"from tests import paged_kernel_test as t; t._mesh_child({str(tmp_path)!r})", 4,
      timeout=900, result=tmp_path / "rows.json")
  ref, out = rows["False"], rows["True"]
  assert ref["lengths"] == out["lengths"] and ref["tokens"] == out["tokens"]
  np.testing.assert_allclose(out["logprobs"], ref["logprobs"], rtol=0, atol=1e-5)
  np.testing.assert_allclose(out["entropy"], ref["entropy"], rtol=0, atol=1e-5)


def test_a_kernel_block_holds_1024_keys_or_1_mib_of_keys_and_values():
  bf16 = "bfloat16"
  assert paged_kernel.block_pages((9, 64, 4, 128), bf16, 144) == 16  # 2 KV heads a chip
  assert paged_kernel.block_pages((9, 64, 2, 128), bf16, 144) == 16  # 1: still 1024 keys
  assert paged_kernel.block_pages((9, 64, 16, 128), bf16, 144) == 4  # 8: 1 MiB
  assert paged_kernel.block_pages((9, 64, 16, 128), bf16, 3) == 3  # a row's pages at most
  assert paged_kernel.block_pages((9, 64, 64, 256), "float32", 144) == 1


def test_the_pool_takes_the_kernels_layout_on_tpu_only():
  cfg = models.ModelConfig(head_dim=128)
  assert not paged_kernel.wanted(cfg, None, 8)  # this host's CPU
