"""One decoding step's token choice: temperature, top-k, top-p, greedy, log-probs, entropy.

Everything here works on float32 logits [B, V] inside the jitted decode loop, so its
cost per step matters (V = 49152 for SmolLM2, 152k for Qwen2.5):

* Sampling is exact inverse-CDF sampling with one uniform per row, done in two levels
  (pick a block of `_BLOCK` tokens by the block masses, then the token inside it), so a
  step costs two passes over the logits instead of the V random numbers and two logs per
  entry of Gumbel-max (which was ~10x slower on CPU).
* top-k uses `lax.top_k` only when `top_k > 0`; top-p finds its probability threshold by
  bisection on the float bit pattern (31 masked sums) instead of sorting V entries, which
  XLA:CPU does slowly. Neither runs when it is off.

What is returned as the token's log-prob: log_softmax(logits / T)[token], the full
temperature-scaled distribution *before* top-k/top-p truncation (the learner's
distribution at the same temperature). With truncation active the token was drawn from
the renormalised kept set, whose log-prob is this value minus log(kept mass).
Greedy decoding (or T = 0) returns the log-prob at T = 1 when T = 0, else at T.
Entropy is the full-vocabulary entropy of softmax(logits / T) in nats.
"""

import jax
import jax.numpy as jnp

_BLOCK = 256


def scale(logits_BxV: jax.Array, temperature: jax.Array) -> jax.Array:
  """logits / T, with T = 0 (greedy) treated as 1."""
  temperature = jnp.asarray(temperature, jnp.float32)
  return logits_BxV / jnp.where(temperature > 0, temperature, 1.0)


def top_k_mask(scaled_BxV: jax.Array, k: int) -> jax.Array:
  """True on the k largest entries of each row (ties with the k-th value are kept)."""
  kth_B = jax.lax.top_k(scaled_BxV, k)[0][:, -1]
  return scaled_BxV >= kth_B[:, None]


def top_p_mask(probs_BxV: jax.Array, top_p: jax.Array) -> jax.Array:
  """True on the nucleus: tokens whose strictly more probable tokens hold < top_p mass.

  `probs_BxV` are normalised probabilities (zeros where already excluded). The kept set
  is {p >= tau} for the smallest tau with mass(p > tau) < top_p; tau is found by
  bisection over the int32 bit patterns of non-negative floats, which order like the
  floats, so 31 steps land on the exact threshold.
  """
  bits_BxV = jax.lax.bitcast_convert_type(probs_BxV, jnp.int32)
  top_p = jnp.asarray(top_p, jnp.float32)

  def mass_above(bits_B):
    return jnp.sum(jnp.where(bits_BxV > bits_B[:, None], probs_BxV, 0.0), axis=-1)

  def body(_, bounds):
    lo_B, hi_B = bounds  # mass_above(lo) >= top_p > mass_above(hi)
    mid_B = lo_B + (hi_B - lo_B) // 2
    below = mass_above(mid_B) < top_p
    return jnp.where(below, lo_B, mid_B), jnp.where(below, mid_B, hi_B)

  lo_B = jnp.full(bits_BxV.shape[:1], -1, jnp.int32)
  hi_B = jnp.max(bits_BxV, axis=-1)
  _, hi_B = jax.lax.fori_loop(0, 31, body, (lo_B, hi_B))
  # hi is the smallest bit pattern with mass_above < top_p; tokens with p >= hi and
  # every token with mass_above(p) < top_p are the same set.
  return bits_BxV >= hi_B[:, None]


def inverse_cdf_sample(weights_BxV: jax.Array, uniform_B: jax.Array) -> jax.Array:
  """Draws index i with probability weights[i] / sum(weights) (weights >= 0).

  Two-level inverse CDF: the block whose cumulative mass first exceeds u * total, then
  the token inside it whose cumulative mass first exceeds the remainder. An index with
  zero weight is never returned (rounding at the top end falls back to the last block
  or token that has weight).
  """
  B, V = weights_BxV.shape
  nb = -(-V // _BLOCK)
  w_BxNxK = jnp.pad(weights_BxV, ((0, 0), (0, nb * _BLOCK - V))).reshape(B, nb, _BLOCK)
  block_cum_BxN = jnp.cumsum(jnp.sum(w_BxNxK, axis=-1), axis=-1)
  target_B = uniform_B * block_cum_BxN[:, -1]
  last_block_B = jnp.argmax(jnp.where(block_cum_BxN >= block_cum_BxN[:, -1:], 1, 0), -1)
  block_B = jnp.minimum(jnp.sum(block_cum_BxN <= target_B[:, None], axis=-1), last_block_B)
  before_B = jnp.where(block_B > 0,
                       jnp.take_along_axis(block_cum_BxN, jnp.maximum(block_B - 1, 0)[:, None],
                                           axis=-1)[:, 0], 0.0)
  inner_BxK = jnp.take_along_axis(w_BxNxK, block_B[:, None, None], axis=1)[:, 0]
  inner_cum_BxK = jnp.cumsum(inner_BxK, axis=-1)
  last_inner_B = jnp.argmax(jnp.where(inner_cum_BxK >= inner_cum_BxK[:, -1:], 1, 0), -1)
  inner_B = jnp.minimum(jnp.sum(inner_cum_BxK <= (target_B - before_B)[:, None], axis=-1),
                        last_inner_B)
  return (block_B * _BLOCK + inner_B).astype(jnp.int32)


def choose_tokens(logits_BxV: jax.Array, keys_B: jax.Array, temperature: jax.Array,
                  top_p: jax.Array, greedy: jax.Array, *, top_k: int, use_top_p: bool,
                  return_entropy: bool):
  """Picks one token per row; returns (token_B int32, logprob_B, entropy_B or None).

  Args:
    logits_BxV: float32 logits.
    keys_B: one PRNG key per row (rows are independent of their batch neighbours).
    temperature: scalar T.
    top_p: scalar nucleus mass (used when `use_top_p`).
    greedy: scalar bool, argmax instead of sampling (traced, so greedy and sampled
      generation share one compiled program; the draw is cheap next to the model).
    top_k: static; 0 disables.
    use_top_p: static; whether the top-p filter runs at all.
    return_entropy: static; whether to compute the full-vocabulary entropy.
  """
  scaled_BxV = scale(logits_BxV, temperature)
  max_B = jnp.max(scaled_BxV, axis=-1)
  exp_BxV = jnp.exp(scaled_BxV - max_B[:, None])
  sum_B = jnp.sum(exp_BxV, axis=-1)
  logz_B = max_B + jnp.log(sum_B)
  weights_BxV = exp_BxV
  if top_k > 0:
    weights_BxV = jnp.where(top_k_mask(scaled_BxV, top_k), weights_BxV, 0.0)
  if use_top_p:
    probs_BxV = weights_BxV / jnp.sum(weights_BxV, axis=-1, keepdims=True)
    weights_BxV = jnp.where(top_p_mask(probs_BxV, top_p), weights_BxV, 0.0)
  uniform_B = jax.vmap(jax.random.uniform)(keys_B)
  token_B = jnp.where(greedy, jnp.argmax(scaled_BxV, axis=-1).astype(jnp.int32),
                      inverse_cdf_sample(weights_BxV, uniform_B))
  logprob_B = jnp.take_along_axis(scaled_BxV, token_B[:, None], axis=-1)[:, 0] - logz_B
  entropy_B = None
  if return_entropy:
    entropy_B = logz_B - jnp.sum(exp_BxV * scaled_BxV, axis=-1) / sum_B
  return token_B, logprob_B, entropy_B
