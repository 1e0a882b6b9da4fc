"""Attention implementations against the einsum reference, and packed rows.

Relative error of an array = max |x - x_ref| / max |x_ref| (so near-zero gradient entries
do not dominate). float32: 1e-5. bfloat16 compute: 2e-2 on logits, log-probs and
entropies, 5e-2 on parameter gradients (the einsum reference rounds the probabilities'
gradient to bfloat16, blockwise keeps it in float32).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exgrpo_jax import logprobs
from exgrpo_jax import models
from exgrpo_jax.models import attention
from exgrpo_jax.models import blockwise

LLAMA = models.ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2,
                           num_heads=6, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
QWEN2 = LLAMA.replace(model_type="qwen2", attention_bias=True, num_heads=8, num_kv_heads=1,
                      rope_theta=1e6, tie_word_embeddings=True)
TOLERANCES = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 5e-2)}  # (outputs, gradients)
T = 45  # not a multiple of the test block
CPU_IMPLEMENTATIONS = [name for name in attention.supported("cpu", "cpu")
                       if name not in ("auto", "xla")]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
  monkeypatch.setattr(blockwise, "BLOCK", 16)


def random_params(cfg, seed=0):
  """Init params with every leaf (biases and norms too) randomised."""
  params = models.init_params(cfg, jax.random.key(seed))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree.unflatten(treedef, [
      x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def padded_batch(vocab):
  tokens = np.random.default_rng(1).integers(0, vocab, (2, T)).astype(np.int32)
  valid = np.ones((2, T), bool)
  valid[0, :6] = False  # left padding
  return dict(tokens_BxT=tokens, valid_BxT=valid), valid


def packed_batch(vocab):
  tokens = np.random.default_rng(2).integers(0, vocab, (2, T)).astype(np.int32)
  segments = np.zeros((2, T), np.int32)
  segments[0, :20], segments[0, 20:37] = 1, 2
  segments[1, :30] = 1
  return dict(tokens_BxT=tokens, segment_ids_BxT=segments), segments != 0


def outputs(cfg, params, batch, scored_BxT):
  """(logits, log-probs, entropies) at scored positions and the gradient of their sum."""
  def loss(params):
    hidden, _ = models.apply(cfg, params, batch["tokens_BxT"], batch.get("valid_BxT"),
                             return_hidden=True,
                             segment_ids_BxT=batch.get("segment_ids_BxT"))
    w = models.unembedding(cfg, params)
    logits = jnp.einsum("btd,dv->btv", hidden, w.astype(hidden.dtype),
                        preferred_element_type=jnp.float32)
    logp, entropy = logprobs.token_logprobs_and_entropy(
        hidden[:, :-1], w, batch["tokens_BxT"][:, 1:], chunk_size=16)
    scored = scored_BxT[:, 1:] & scored_BxT[:, :-1]
    objective = jnp.sum(jnp.where(scored, logp + 0.1 * entropy, 0.0))
    return objective, (logits[scored_BxT], logp[scored], entropy[scored])
  (_, values), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return values, grads


def relative_error(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-30)


# Every model, layout and dtype once in the default suite; the rest of the cross product
# is slow.
_CASES = [
    pytest.param(cfg, layout, dtype, id=f"{name}-{layout}-{dtype}",
                 marks=() if (i + j + k) % 2 == 0 else pytest.mark.slow)
    for i, (name, cfg) in enumerate((("llama", LLAMA), ("qwen2", QWEN2)))
    for j, layout in enumerate(("padded", "packed"))
    for k, dtype in enumerate(("float32", "bfloat16"))]


@pytest.mark.parametrize("impl", CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("cfg,layout,dtype", _CASES)
def test_matches_xla(cfg, layout, dtype, impl):
  cfg = cfg.replace(dtype=dtype)
  params = random_params(cfg)
  batch, scored = (padded_batch if layout == "padded" else packed_batch)(cfg.vocab_size)
  ref_values, ref_grads = outputs(cfg.replace(attention="xla"), params, batch, scored)
  values, grads = outputs(cfg.replace(attention=impl), params, batch, scored)
  out_tol, grad_tol = TOLERANCES[dtype]
  for name, x, ref in zip(("logits", "logp", "entropy"), values, ref_values):
    assert relative_error(x, ref) <= out_tol, (name, relative_error(x, ref))
  errors = jax.tree.map(relative_error, grads, ref_grads)
  worst = max(jax.tree.leaves(errors))
  assert worst <= grad_tol, errors


@pytest.mark.parametrize("impl", CPU_IMPLEMENTATIONS)
def test_prefill_into_cache_matches_xla(impl):
  cfg = QWEN2
  params = random_params(cfg)
  tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 21)).astype(np.int32)
  valid = np.ones((2, 21), bool)
  valid[1, :4] = False
  results = {}
  for name in ("xla", impl):
    cache = models.KVCache.zeros(cfg, 2, 40)
    logits, cache = models.apply(cfg.replace(attention=name), params, tokens, valid,
                                 cache=cache)
    results[name] = logits[valid], cache
  (ref_logits, ref_cache), (logits, cache) = results["xla"], results[impl]
  assert relative_error(logits, ref_logits) <= 1e-5
  np.testing.assert_array_equal(cache.valid_BxS, ref_cache.valid_BxS)
  assert int(cache.index) == int(ref_cache.index) == 21
  # Padding slots hold whatever a query that attends to nothing computes; never read.
  slots = np.asarray(cache.valid_BxS)
  k, ref_k = (np.moveaxis(np.asarray(c.k_LxBxKxDhxS), 4, 2) for c in (cache, ref_cache))
  v, ref_v = (np.asarray(c.v_LxBxKxSxDh).transpose(0, 1, 3, 2, 4) for c in (cache, ref_cache))
  assert relative_error(k[:, slots], ref_k[:, slots]) <= 1e-5
  assert relative_error(v[:, slots], ref_v[:, slots]) <= 1e-5


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
def test_cudnn_matches_xla():
  cfg = QWEN2.replace(dtype="bfloat16")
  params = random_params(cfg)
  batch, scored = padded_batch(cfg.vocab_size)
  ref_values, ref_grads = outputs(cfg.replace(attention="xla"), params, batch, scored)
  values, grads = outputs(cfg.replace(attention="cudnn"), params, batch, scored)
  out_tol, grad_tol = TOLERANCES["bfloat16"]
  for x, ref in zip(values, ref_values):
    assert relative_error(x, ref) <= out_tol
  assert max(jax.tree.leaves(jax.tree.map(relative_error, grads, ref_grads))) <= grad_tol


def test_cudnn_pads_odd_lengths_and_matches_xla(monkeypatch):
  """cuDNN's backward with a mask refuses odd T or S (seen on an H200). Here, without a
  GPU, `jax.nn.dot_product_attention` is XLA's behind a check that refuses odd lengths as
  cuDNN does; the padded call must give the einsum reference's values and gradients."""
  dot_product_attention = jax.nn.dot_product_attention

  def refuses_odd_lengths(q, k, v, mask, implementation):
    assert implementation == "cudnn"
    if q.shape[1] % 2 or k.shape[1] % 2:
      raise NotImplementedError(f"Unsupported sequence length Q {q.shape[1]}, "
                                f"KV {k.shape[1]}.")
    return dot_product_attention(q, k, v, mask=mask)

  monkeypatch.setattr(jax.nn, "dot_product_attention", refuses_odd_lengths)
  B, T, H, K, Dh = 2, 45, 4, 2, 64
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(B, K, Dh, T)), jnp.bfloat16)
  v = jnp.asarray(rng.normal(size=(B, K, T, Dh)), jnp.bfloat16)
  segments = np.ones((B, T), np.int32)
  segments[0, 30:], segments[1, -7:] = 2, 0
  mask = attention.AttentionMask.packed(jnp.asarray(segments))
  scored = (segments != 0)[..., None, None]

  def loss(fn):
    return lambda q, k, v: jnp.sum(
        jnp.where(scored, fn(q, k, v, mask).astype(jnp.float32), 0.0) ** 2)
  ref = jax.value_and_grad(loss(attention.IMPLEMENTATIONS.get("xla")), (0, 1, 2))(q, k, v)
  got = jax.value_and_grad(loss(attention.IMPLEMENTATIONS.get("cudnn")), (0, 1, 2))(q, k, v)
  out_tol, grad_tol = TOLERANCES["bfloat16"]
  assert relative_error(got[0], ref[0]) <= out_tol
  for x, r in zip(got[1], ref[1]):
    assert relative_error(x, r) <= grad_tol


def test_splash_in_pallas_interpreter_matches_xla():
  """The TPU kernel's numerics on CPU: values and q/k/v gradients, GQA, packed rows."""
  from exgrpo_jax.models import splash  # pylint: disable=g-import-not-at-top
  B, T, H, K, Dh = 1, 150, 4, 2, 128  # T pads to two 128-blocks
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, K, Dh, T)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, K, T, Dh)), jnp.float32)
  segments = np.ones((B, T), np.int32)
  segments[0, :10], segments[0, 60:], segments[0, -5:] = 0, 2, 0
  mask = attention.AttentionMask.packed(jnp.asarray(segments))
  scored = (segments != 0)[..., None, None]

  def loss(fn):
    return lambda q, k, v: jnp.sum(jnp.where(scored, fn(q, k, v, mask), 0.0) ** 2)
  ref = jax.value_and_grad(loss(attention.IMPLEMENTATIONS.get("xla")), (0, 1, 2))(q, k, v)
  got = jax.value_and_grad(loss(functools.partial(splash.attention, interpret=True)),
                           (0, 1, 2))(q, k, v)
  for x, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    assert relative_error(x, r) <= 1e-5


def _attention_grad_temp_bytes(impl: str, S: int) -> int:
  B, H, K, Dh = 1, 4, 2, 32
  sds = jax.ShapeDtypeStruct
  mask = attention.AttentionMask.padded(jnp.ones((B, S), bool))

  def loss(q, k, v):
    return jnp.sum(attention.attend(impl, q, k, v, mask) ** 2)
  args = (sds((B, S, H, Dh), jnp.float32), sds((B, K, Dh, S), jnp.float32),
          sds((B, K, S, Dh), jnp.float32))
  compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(*args).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_is_linear_in_length(monkeypatch):
  """XLA's memory analysis (compile only) of attention's gradient."""
  monkeypatch.setattr(blockwise, "BLOCK", 512)
  temps = {impl: [_attention_grad_temp_bytes(impl, S) for S in (2048, 4096)]
           for impl in ("xla", "blockwise")}
  assert temps["blockwise"][1] <= 2.2 * temps["blockwise"][0], temps
  assert temps["xla"][1] >= 3 * temps["blockwise"][1], temps


def test_unavailable_implementation_is_one_line_naming_alternatives():
  with pytest.raises(ValueError) as error:
    attention.check_supported("cudnn", platform="cpu", device_kind="cpu")
  assert str(error.value) == ("model.attention='cudnn' cannot run on cpu (cpu); "
                              "choose one of auto, xla, blockwise")
  with pytest.raises(ValueError, match="attention must be one of"):
    LLAMA.replace(attention="flash")


def test_auto_on_cpu_picks_by_length():
  assert attention.resolve("auto", jnp.float32, 256) == "xla"
  assert attention.resolve("auto", jnp.float32, 4096) == "blockwise"


@pytest.mark.parametrize("cfg", [LLAMA, QWEN2], ids=["llama", "qwen2"])
def test_packed_row_matches_each_sequence_alone(cfg):
  params = random_params(cfg)
  rng = np.random.default_rng(0)
  lengths = (7, 5, 3)
  seqs = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in lengths]
  pad = 4
  tokens = np.concatenate(seqs + [np.zeros(pad, np.int32)])[None]
  segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)]
                            + [np.zeros(pad)]).astype(np.int32)[None]
  packed, _ = models.apply(cfg, params, jnp.asarray(tokens), segment_ids_BxT=segments)
  positions = np.concatenate([np.arange(n) for n in lengths] + [np.arange(pad)])[None]
  explicit, _ = models.apply(cfg, params, jnp.asarray(tokens), positions_BxT=positions,
                             segment_ids_BxT=segments)
  np.testing.assert_array_equal(np.asarray(packed), np.asarray(explicit))
  start = 0
  for seq in seqs:
    alone, _ = models.apply(cfg, params, jnp.asarray(seq)[None])
    np.testing.assert_allclose(np.asarray(packed[0, start:start + len(seq)]),
                               np.asarray(alone[0]), rtol=1e-5, atol=1e-5)
    start += len(seq)


def test_segments_with_cache_are_refused():
  params = random_params(LLAMA)
  cache = models.KVCache.zeros(LLAMA, 1, 8)
  with pytest.raises(ValueError, match="not supported with a KV cache"):
    models.apply(LLAMA, params, jnp.zeros((1, 4), jnp.int32), cache=cache,
                 segment_ids_BxT=jnp.ones((1, 4), jnp.int32))
