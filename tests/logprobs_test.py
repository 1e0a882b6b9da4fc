"""Tests for exgrpo_jax.logprobs: chunked log-probs/entropy against the naive full-logits
path (values, gradients, the model wrapper, real SmolLM2) and the memory it saves."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exgrpo_jax import logprobs
from exgrpo_jax import models

TINY = models.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16)


_naive = logprobs.full_logits_logprobs_and_entropy


def _numpy_reference(hidden, unembed, targets, temperature=1.0):
  """log-probs and entropies in float64 NumPy."""
  z = np.einsum("btd,dv->btv", np.asarray(hidden, np.float64),
                np.asarray(unembed, np.float64)) / temperature
  z -= z.max(axis=-1, keepdims=True)
  logp_all = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
  logp = np.take_along_axis(logp_all, np.asarray(targets)[..., None], axis=-1)[..., 0]
  return logp, -(np.exp(logp_all) * logp_all).sum(axis=-1)


def _random_problem(seed, B=3, T=37, D=32, V=1000, dtype=jnp.float32):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  hidden = jax.random.normal(k1, (B, T, D), dtype)
  unembed = (jax.random.normal(k2, (D, V)) * 0.5).astype(dtype)
  return hidden, unembed, jax.random.randint(k3, (B, T), 0, V)


@pytest.mark.parametrize("chunk_size,temperature", [(16, 1.0), (1, 0.7), (500, 1.3)])
def test_chunked_equals_naive_values_and_gradients(chunk_size, temperature):
  hidden, unembed, targets = _random_problem(0)
  chunked = functools.partial(logprobs.token_logprobs_and_entropy, chunk_size=chunk_size,
                              temperature=temperature)
  logp, entropy = jax.jit(chunked)(hidden, unembed, targets)
  assert logp.dtype == entropy.dtype == jnp.float32
  naive = _naive(hidden, unembed, targets, temperature)
  for got, want in zip((logp, entropy), naive):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  for path in (logp, entropy), naive:
    for got, want in zip(path, _numpy_reference(hidden, unembed, targets, temperature)):
      np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  # An objective using both outputs, with per-position weights so every term matters.
  w1, w2 = jax.random.normal(jax.random.key(1), (2,) + targets.shape)

  def objective(fn, h, u):
    lp, ent = fn(h, u, targets)
    return jnp.sum(w1 * lp) + jnp.sum(w2 * ent)

  grads = jax.jit(jax.grad(functools.partial(objective, chunked), argnums=(0, 1)))(hidden,
                                                                                   unembed)
  grads_ref = jax.grad(functools.partial(objective, functools.partial(
      _naive, temperature=temperature)), argnums=(0, 1))(hidden, unembed)
  for g, g_ref in zip(grads, grads_ref):
    np.testing.assert_allclose(g, g_ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("second_temperature", [0.7, 1.3])
def test_two_temperatures_from_one_pass(second_temperature):
  """The rollout temperature's log-probs (TIS, docs/algorithm.md §19) beside the
  temperature-1 ones, against float64 NumPy at each temperature."""
  hidden, unembed, targets = _random_problem(3)
  logp, entropy, second = jax.jit(functools.partial(
      logprobs.token_logprobs_at_two_temperatures, second_temperature=second_temperature,
      chunk_size=16))(hidden, unembed, targets)
  for got, want in zip((logp, entropy), _numpy_reference(hidden, unembed, targets)):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(
      second, _numpy_reference(hidden, unembed, targets, second_temperature)[0],
      atol=1e-5, rtol=1e-5)


def test_logprobs_only_and_bfloat16_inputs():
  hidden, unembed, targets = _random_problem(2, dtype=jnp.bfloat16)
  logp, entropy = logprobs.token_logprobs_and_entropy(hidden, unembed, targets, chunk_size=8,
                                                      compute_entropy=False)
  assert entropy is None and logp.dtype == jnp.float32
  np.testing.assert_allclose(logp, _naive(hidden, unembed, targets)[0], atol=1e-5)
  # bfloat16 gradients against float32 ones from the same (bfloat16-valued) inputs: equal
  # up to bfloat16 rounding (2^-8 relative) of the logit gradients used in the matmuls
  # (measured: 0.3% of the largest entry, as for the naive path in bfloat16).
  def objective(fn, h, u):
    lp, ent = fn(h, u, targets)
    return jnp.sum(lp) + 0.5 * jnp.sum(ent)

  chunked = functools.partial(logprobs.token_logprobs_and_entropy, chunk_size=8)
  grads = jax.grad(functools.partial(objective, chunked), argnums=(0, 1))(hidden, unembed)
  grads32 = jax.grad(functools.partial(objective, _naive), argnums=(0, 1))(
      hidden.astype(jnp.float32), unembed.astype(jnp.float32))
  for g, g32 in zip(grads, grads32):
    assert g.dtype == jnp.bfloat16
    scale = np.abs(np.asarray(g32)).max()
    np.testing.assert_allclose(np.asarray(g, np.float32), g32, atol=1e-2 * scale)


def _check_sequence_logprobs(cfg, params, tokens, valid):
  @jax.jit
  def run(params):
    """Ours, the model's final hidden states and the model's own logits, in one compile."""
    return (logprobs.sequence_logprobs(cfg, params, tokens, valid, chunk_size=7),
            models.apply(cfg, params, tokens, valid, return_hidden=True)[0],
            models.apply(cfg, params, tokens, valid)[0])

  (logp, entropy), hidden, logits = run(params)
  assert logp.shape == entropy.shape == tokens.shape
  np.testing.assert_array_equal(logp[:, 0], 0)
  np.testing.assert_array_equal(entropy[:, 0], 0)
  mask = np.asarray(valid)[:, 1:]
  # Against the full-logits path on the same hidden states: the 1e-5 criterion.
  full = _naive(hidden[:, :-1], models.unembedding(cfg, params), tokens[:, 1:])
  for got, want in zip((logp, entropy), full):
    np.testing.assert_allclose(np.asarray(got)[:, 1:][mask], np.asarray(want)[mask],
                               atol=1e-5)
  # Against log_softmax of the model's own logits (alignment and wiring). These come from
  # a differently ordered float32 matmul, so they may differ by a few float32 spacings of
  # the largest logit (3.8e-6 at |z| = 40 for SmolLM2).
  logits = np.asarray(logits, np.float64)
  logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  expected = np.take_along_axis(logp_all[:, :-1], np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  atol = 1e-5 + 8 * np.spacing(np.float32(np.abs(logits).max()))
  np.testing.assert_allclose(np.asarray(logp)[:, 1:][mask], expected[mask], atol=atol)
  entropy_ref = -(np.exp(logp_all) * logp_all).sum(-1)[:, :-1]
  np.testing.assert_allclose(np.asarray(entropy)[:, 1:][mask], entropy_ref[mask], atol=atol)


def test_sequence_logprobs_matches_model_logits_tiny():
  params = models.init_params(TINY, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 11), 0, TINY.vocab_size)
  valid = jnp.ones((2, 11), bool).at[1, :3].set(False)  # left padding
  _check_sequence_logprobs(TINY, params, tokens, valid)


@pytest.mark.slow  # the real model: compiling it takes 10-40 s on 2 shared cores
def test_sequence_logprobs_matches_model_logits_smollm2():
  policy = models.from_pretrained()
  tokenizer = models.load_tokenizer()
  ids = tokenizer("The capital of France is Paris. 12 + 35 = 47")["input_ids"]
  tokens = jnp.asarray([ids])
  _check_sequence_logprobs(policy.config, policy.params, tokens, jnp.ones_like(tokens, bool))


QWEN_SHAPES = dict(B=2, T=4096, D=3584, V=152064)  # Qwen2.5-Math-7B's unembedding


def compiled_memory(fn, dtype, grad: bool) -> dict[str, int]:
  """XLA memory analysis of `fn` (or of the gradient of its summed outputs), compile only."""
  B, T, D, V = (QWEN_SHAPES[x] for x in "BTDV")
  args = (jax.ShapeDtypeStruct((B, T, D), dtype), jax.ShapeDtypeStruct((D, V), dtype),
          jax.ShapeDtypeStruct((B, T), jnp.int32))
  if grad:
    fn = jax.grad(lambda h, u, t, f=fn: sum(x.sum() for x in f(h, u, t)), argnums=(0, 1))
  analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
  return dict(temp=analysis.temp_size_in_bytes, arguments=analysis.argument_size_in_bytes,
              outputs=analysis.output_size_in_bytes)


# bfloat16 with backward is left to scripts/bench/bench_logprobs.py: XLA:CPU upcasts the whole
# bfloat16 unembedding to float32 there (2.2 GB), a CPU artefact that puts it at ~1/4.
@pytest.mark.parametrize("dtype,grad", [(jnp.float32, False), (jnp.float32, True),
                                        (jnp.bfloat16, False)])
def test_chunked_peak_memory_is_under_a_quarter_of_naive(dtype, grad):
  chunked = functools.partial(logprobs.token_logprobs_and_entropy, chunk_size=1024)
  ours = compiled_memory(chunked, dtype, grad)
  naive = compiled_memory(_naive, dtype, grad)
  logits_bytes = 4 * QWEN_SHAPES["B"] * QWEN_SHAPES["T"] * QWEN_SHAPES["V"]
  assert naive["temp"] >= logits_bytes  # the naive path really holds [B, T, V] float32
  assert ours["temp"] <= naive["temp"] / 4, (ours, naive)
