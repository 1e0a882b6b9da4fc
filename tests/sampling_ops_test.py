"""Token choice against NumPy references: top-k/top-p sets, exact sampling (chi-square),
and host-side stop strings with the real tokenizer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special
from scipy import stats

from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax.sampling import categorical
from exgrpo_jax.sampling import outputs

from tests import sampler_test


def mass_above(probs_V: np.ndarray) -> np.ndarray:
  """Per token, the float64 probability mass of the tokens ranked above it."""
  order = np.argsort(-probs_V, kind="stable")
  above = np.empty(probs_V.shape)
  above[order] = np.cumsum(probs_V[order], dtype=np.float64) - probs_V[order]
  return above


def nucleus_reference(probs_V: np.ndarray, top_p: float) -> np.ndarray:
  """HF/vLLM top-p: keep a token iff the tokens ranked above it hold < top_p mass."""
  return mass_above(probs_V) < top_p


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_mask_matches_sorted_reference(top_p):
  logits = np.random.default_rng(0).normal(0, 2.0, (16, 3000)).astype(np.float32)
  probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), -1))
  mask = np.asarray(jax.jit(categorical.top_p_mask)(probs, top_p))
  for row in range(len(probs)):
    above = mass_above(probs[row])
    # Within float32 rounding of the boundary either answer is right.
    clear = np.abs(above - top_p) > 1e-5
    np.testing.assert_array_equal(mask[row][clear], (above < top_p)[clear])


def test_top_k_mask_keeps_the_k_largest():
  logits = np.random.default_rng(1).normal(size=(8, 500)).astype(np.float32)
  mask = np.asarray(categorical.top_k_mask(jnp.asarray(logits), 7))
  expected = logits >= np.sort(logits, -1)[:, -7:][:, :1]
  np.testing.assert_array_equal(mask, expected)
  assert (mask.sum(-1) == 7).all()


def test_inverse_cdf_never_returns_zero_weight():
  rng = np.random.default_rng(2)
  weights = rng.random((64, 1000)).astype(np.float32)
  weights[rng.random(weights.shape) < 0.97] = 0.0
  weights[:, 256:768] = 0.0  # whole empty blocks
  weights[:, 0] = 1e-30  # a tiny first weight
  uniforms = np.concatenate([[0.0, 1.0 - 2**-24], rng.random(62)]).astype(np.float32)
  for shift in range(8):
    idx = np.asarray(categorical.inverse_cdf_sample(jnp.asarray(np.roll(weights, shift, 0)),
                                                    jnp.asarray(uniforms)))
    assert (np.roll(weights, shift, 0)[np.arange(64), idx] > 0).all()


def draw(logits_V, count, seed, **options):
  """`count` independent draws from one row of logits through `choose_tokens`."""
  logits = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (count, len(logits_V)))
  keys = jax.random.split(jax.random.key(seed), count)
  fn = jax.jit(functools.partial(categorical.choose_tokens, return_entropy=False,
                                 top_k=options.pop("top_k", 0),
                                 use_top_p=options.get("top_p", 1.0) < 1.0))
  tokens, _, _ = fn(logits, keys, options.get("temperature", 1.0), options.get("top_p", 1.0),
                    False)
  return np.asarray(tokens)


def assert_matches(samples, probs, min_p_value=1e-3):
  """Chi-square goodness of fit; bins with expected count < 5 are pooled."""
  counts = np.bincount(samples, minlength=len(probs))
  assert counts[probs == 0].sum() == 0, "drew a token outside the allowed set"
  expected = probs * len(samples)
  big = expected >= 5
  f_obs = np.append(counts[big], counts[~big].sum())
  f_exp = np.append(expected[big], expected[~big].sum())
  if f_exp[-1] == 0:
    f_obs, f_exp = f_obs[:-1], f_exp[:-1]
  assert stats.chisquare(f_obs, f_exp).pvalue > min_p_value


LOGITS = np.random.default_rng(3).normal(0, 1.5, 200)


@pytest.mark.parametrize("options", [
    dict(), dict(temperature=0.6), dict(top_k=10), dict(top_p=0.7, temperature=1.3),
    dict(top_k=40, top_p=0.5),
], ids=["T1", "T0.6", "topk10", "topp0.7-T1.3", "topk40-topp0.5"])
def test_samples_follow_the_truncated_softmax(options):
  temperature = options.get("temperature", 1.0)
  probs = special.softmax(LOGITS / temperature)
  keep = np.ones(len(probs), bool)
  if options.get("top_k"):
    keep &= LOGITS >= np.sort(LOGITS)[-options["top_k"]]
  if options.get("top_p", 1.0) < 1.0:
    keep &= nucleus_reference(np.where(keep, probs, 0) / probs[keep].sum(), options["top_p"])
  target = np.where(keep, probs, 0.0) / probs[keep].sum()
  assert_matches(draw(LOGITS, 20000, seed=4, **options), target)


def test_engine_next_token_matches_model_softmax():
  """The whole engine path (prefill, cache, sampling) at T = 1 on the tiny model."""
  cfg, params = sampler_test.tiny_model()
  prompt = [5, 6, 7, 8]
  out = sampling.make_engine("jax", cfg, None).generate(
      [prompt], 4000, params, jax.random.key(0), sampling.SamplingConfig(max_new_tokens=1))
  logits, _ = models.apply(cfg, params, np.array([prompt], np.int32))
  assert_matches(out.tokens_NxT[:, 0], special.softmax(np.asarray(logits[0, -1], np.float64)))


@pytest.fixture(scope="module")
def tokenizer():
  try:
    return models.load_tokenizer()
  except (FileNotFoundError, ImportError) as e:
    pytest.skip(f"embedded tokenizer unavailable: {e}")


def test_stop_strings_truncate_on_the_host(tokenizer):
  text = "Let me think. The answer is 42. Then some more text"
  ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
  T = len(ids) + 3
  tokens = np.zeros((2, T), np.int32)
  tokens[:, :len(ids)] = ids
  logp = np.full((2, T), -0.5, np.float32)
  out = outputs.finalize(tokens, logp, None, np.array([len(ids)] * 2), np.array([True] * 2),
                         np.array([0, 1]), tokenizer, ("is 42.", "never"),
                         tokenizer.pad_token_id)
  assert out.texts == ["Let me think. The answer is 42."] * 2
  keep = len(tokenizer("Let me think. The answer is 42.", add_special_tokens=False)
             ["input_ids"])
  np.testing.assert_array_equal(out.lengths_N, [keep, keep])
  np.testing.assert_array_equal(out.mask_NxT[0], np.arange(T) < keep)
  assert (out.tokens_NxT[:, keep:] == tokenizer.pad_token_id).all()
  assert (out.logprobs_NxT[:, keep:] == 0).all() and not out.truncated_N.any()
  plain = outputs.finalize(tokens, logp, None, np.array([len(ids)] * 2), np.array([True] * 2),
                           np.array([0, 1]), tokenizer, (), tokenizer.pad_token_id)
  assert plain.texts == [text] * 2 and (plain.lengths_N == len(ids)).all()
