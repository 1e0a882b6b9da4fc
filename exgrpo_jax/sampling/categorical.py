"""One decoding step's token choice: temperature, top-k, top-p, greedy, log-probs, entropy.

Everything here works on float32 logits [B, V] inside the jitted decode loop, so its
cost per step matters (V = 49152 for SmolLM2, 152k for Qwen2.5):

* Sampling is exact inverse-CDF sampling with one uniform per row, done in two levels
  (pick a block of `_BLOCK` tokens by the block masses, then the token inside it), so a
  step costs two passes over the logits instead of the V random numbers and two logs per
  entry of Gumbel-max (which was ~10x slower on CPU).
* top-k and top-p find their thresholds by bisection over the 2^32 float values (32
  passes of a masked count or sum) instead of sorting V entries or `lax.top_k`, which
  XLA:CPU runs slowly (~0.5 s per call at [64, 49152] for k >= 20). Neither runs when it
  is off.
* Greedy picks the lowest index attaining the row maximum (argmax's tie rule) with a
  plain min-reduction, under `lax.cond`, so the sampled path pays nothing for it.

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


def _order_key(x: jax.Array) -> jax.Array:
  """uint32 keys that order like the float32 values (for non-NaN values)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _from_order_key(key: jax.Array) -> jax.Array:
  """Inverse of `_order_key`."""
  bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _bisect(x_BxV: jax.Array, go_low) -> jax.Array:
  """Per row, the smallest float32 t with `go_low(t)`, for a `go_low` that is monotone in
  t, False just below the row's minimum and True at its maximum. Exact: 32 halvings of
  the uint32 keys that order the float32 values."""
  def body(_, bounds):
    lo_B, hi_B = bounds  # go_low(lo) is False, go_low(hi) is True
    mid_B = lo_B + (hi_B - lo_B) // 2
    low = go_low(_from_order_key(mid_B))
    return jnp.where(low, lo_B, mid_B), jnp.where(low, mid_B, hi_B)

  lo_B = _order_key(jnp.min(x_BxV, axis=-1)) - 1
  hi_B = _order_key(jnp.max(x_BxV, axis=-1))
  _, hi_B = jax.lax.fori_loop(0, 32, body, (lo_B, hi_B))
  return _from_order_key(hi_B)


def top_k_mask(scaled_BxV: jax.Array, k: int) -> jax.Array:
  """True on the k largest entries of each row (ties with the k-th value are kept).

  The k-th largest value is the smallest t with fewer than k entries above it.
  """
  kth_B = _bisect(scaled_BxV, lambda t_B: jnp.sum(scaled_BxV > t_B[:, None], axis=-1) < k)
  return scaled_BxV >= kth_B[:, None]


def top_p_mask(probs_BxV: jax.Array, top_p: jax.Array) -> jax.Array:
  """True on the nucleus: tokens whose strictly more probable tokens hold < top_p mass.

  `probs_BxV` are normalised probabilities (zeros where already excluded). The kept set
  is {p >= tau} for the smallest tau with mass(p > tau) < top_p.
  """
  top_p = jnp.asarray(top_p, jnp.float32)
  tau_B = _bisect(probs_BxV, lambda t_B: jnp.sum(
      jnp.where(probs_BxV > t_B[:, None], probs_BxV, 0.0), axis=-1) < top_p)
  return probs_BxV >= tau_B[:, None]


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
      generation share one compiled program).
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
  token_B = jax.lax.cond(
      greedy,
      lambda: jnp.min(jnp.where(scaled_BxV == max_B[:, None],
                                jnp.arange(scaled_BxV.shape[1], dtype=jnp.int32),
                                scaled_BxV.shape[1]), axis=-1),
      lambda: inverse_cdf_sample(weights_BxV, uniform_B))
  logprob_B = jnp.take_along_axis(scaled_BxV, token_B[:, None], axis=-1)[:, 0] - logz_B
  entropy_B = None
  if return_entropy:
    entropy_B = logz_B - jnp.sum(exp_BxV * scaled_BxV, axis=-1) / sum_B
  return token_B, logprob_B, entropy_B
