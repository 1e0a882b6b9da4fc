"""Per-token log-probs and full-vocabulary entropies without materialising [B, T, V] logits.

At Qwen's V = 152,064 the float32 logits of one 8,192-token sequence take 5 GB, and their
gradient as much again. Here no pass holds more than about chunk_size x V float32 logits:
  * forward: a scan over chunks of `chunk_size` positions (of the flattened B*T), each
    computing its [chunk, V] logits, logsumexp, target log-prob and entropy;
  * backward (custom VJP): a scan over vocabulary slices [N, V/n] that recomputes those
    logits from the saved logsumexp and entropy. Each slice yields its columns of the
    unembedding gradient in one matmul (no [D, V] float32 accumulator, no bfloat16 sums
    across chunks); the hidden-state gradient accumulates in float32 over slices.
Entropy at temperature tau, in float32:
  z = (h @ W) / tau,   H = logsumexp(z) - sum(softmax(z) * z) = -sum(p log p).
`token_logprobs_at_two_temperatures` (forward only) also scores the targets at a second
temperature from each chunk's logits, so the rollout temperature's log-probs cost one
more logsumexp per chunk, not another matmul.
"""

import functools

import jax
import jax.numpy as jnp

from exgrpo_jax import models


def _dot_f32(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _logprobs_entropy(h_NxD, w_DxV, targets_N, chunk_size, temperature, compute_entropy):
  return _forward(h_NxD, w_DxV, targets_N, chunk_size, temperature, compute_entropy)[:2]


def _forward(h_NxD, w_DxV, targets_N, chunk_size, temperature, compute_entropy,
             second_temperature=None):
  """(logp_N, entropy_N or zeros, logsumexp_N), chunked over positions; with
  `second_temperature`, also the targets' logp_N at it, from the same logits."""
  n, d = h_NxD.shape
  chunk = min(chunk_size, n)
  num_chunks = -(-n // chunk)
  pad = num_chunks * chunk - n
  h_CxSxD = jnp.pad(h_NxD, ((0, pad), (0, 0))).reshape(num_chunks, chunk, d)
  targets_CxS = jnp.pad(targets_N, (0, pad)).reshape(num_chunks, chunk)

  def body(carry, xs):
    h_SxD, targets_S = xs
    logits_SxV = _dot_f32(h_SxD, w_DxV)
    z_SxV = logits_SxV / temperature
    lse_S = jax.nn.logsumexp(z_SxV, axis=-1)
    logp_S = jnp.take_along_axis(z_SxV, targets_S[:, None], axis=-1)[:, 0] - lse_S
    if compute_entropy:
      # -sum(p log p) equals lse - sum(p z) without cancelling two large terms.
      logp_SxV = z_SxV - lse_S[:, None]
      entropy_S = -jnp.sum(jnp.exp(logp_SxV) * logp_SxV, axis=-1)
    else:
      entropy_S = jnp.zeros_like(lse_S)
    outs = (logp_S, entropy_S, lse_S)
    if second_temperature is not None:
      y_SxV = logits_SxV / second_temperature
      outs += (jnp.take_along_axis(y_SxV, targets_S[:, None], axis=-1)[:, 0]
               - jax.nn.logsumexp(y_SxV, axis=-1),)
    return carry, outs

  _, outs = jax.lax.scan(body, None, (h_CxSxD, targets_CxS))
  return tuple(x.reshape(-1)[:n] for x in outs)


def _fwd(h_NxD, w_DxV, targets_N, chunk_size, temperature, compute_entropy):
  logp_N, entropy_N, lse_N = _forward(h_NxD, w_DxV, targets_N, chunk_size, temperature,
                                      compute_entropy)
  return (logp_N, entropy_N), (h_NxD, w_DxV, targets_N, lse_N, entropy_N)


def _bwd(chunk_size, temperature, compute_entropy, residuals, cotangents):
  h_NxD, w_DxV, targets_N, lse_N, entropy_N = residuals
  g_logp_N, g_entropy_N = cotangents
  n = h_NxD.shape[0]
  v = w_DxV.shape[1]
  width = min(v, max(1, chunk_size * v // n))  # N x width ~ chunk_size x V logits
  num_slices = -(-v // width)

  def body(carry, i):
    dh_NxD, dw_DxV = carry
    # The last slice is shifted left to stay in bounds; columns an earlier slice already
    # covered are kept out of dh (their dW columns are just written again).
    start = jnp.minimum(i * width, v - width)
    w_DxC = jax.lax.dynamic_slice_in_dim(w_DxV, start, width, axis=1)
    z_NxC = _dot_f32(h_NxD, w_DxC) / temperature
    logp_NxC = z_NxC - lse_N[:, None]
    p_NxC = jnp.exp(logp_NxC)
    column_C = start + jnp.arange(width)
    onehot_NxC = (column_C[None, :] == targets_N[:, None]).astype(jnp.float32)
    dz_NxC = g_logp_N[:, None] * (onehot_NxC - p_NxC)
    if compute_entropy:
      dz_NxC -= g_entropy_N[:, None] * p_NxC * (logp_NxC + entropy_N[:, None])
    dz_NxC = (dz_NxC / temperature).astype(h_NxD.dtype)
    fresh_NxC = jnp.where(column_C >= i * width, dz_NxC, 0)
    dh_NxD += _dot_f32(fresh_NxC, w_DxC.T)
    dw_DxC = _dot_f32(h_NxD.T, dz_NxC).astype(w_DxV.dtype)
    return (dh_NxD, jax.lax.dynamic_update_slice_in_dim(dw_DxV, dw_DxC, start, axis=1)), None

  init = (jnp.zeros(h_NxD.shape, jnp.float32), jnp.zeros_like(w_DxV))
  (dh_NxD, dw_DxV), _ = jax.lax.scan(body, init, jnp.arange(num_slices))
  return dh_NxD.astype(h_NxD.dtype), dw_DxV, None


_logprobs_entropy.defvjp(_fwd, _bwd)


def token_logprobs_and_entropy(hidden_BxTxD, unembed_DxV, targets_BxT, *,
                               chunk_size: int = 1024, temperature: float = 1.0,
                               compute_entropy: bool = True):
  """log pi(target | position) and the entropy of pi at each position.

  Args:
    hidden_BxTxD: final-norm hidden states (any float dtype; the matmuls use it).
    unembed_DxV: the output projection (`models.unembedding`).
    targets_BxT: int token ids whose log-probs are wanted (any id in [0, V) where unused).
    chunk_size: positions per forward chunk; the backward pass holds as many logits.
    temperature: logits are divided by it.
    compute_entropy: False skips the entropy (and returns None for it).

  Returns:
    (logp_BxT float32, entropy_BxT float32 or None); differentiable w.r.t. the hidden
    states and the unembedding.
  """
  B, T, D = hidden_BxTxD.shape
  logp_N, entropy_N = _logprobs_entropy(
      hidden_BxTxD.reshape(B * T, D), unembed_DxV.astype(hidden_BxTxD.dtype),
      targets_BxT.reshape(B * T), chunk_size, temperature, compute_entropy)
  return logp_N.reshape(B, T), entropy_N.reshape(B, T) if compute_entropy else None


def token_logprobs_at_two_temperatures(hidden_BxTxD, unembed_DxV, targets_BxT,
                                       second_temperature: float, *,
                                       chunk_size: int = 1024, compute_entropy: bool = True):
  """`token_logprobs_and_entropy` at temperature 1, forward only, and the targets'
  log-probs at `second_temperature`, from the same logits.

  Returns:
    (logp_BxT, entropy_BxT or None, second_logp_BxT), float32, without gradients.
  """
  B, T, D = hidden_BxTxD.shape
  logp_N, entropy_N, _, second_N = _forward(
      jax.lax.stop_gradient(hidden_BxTxD.reshape(B * T, D)),
      jax.lax.stop_gradient(unembed_DxV.astype(hidden_BxTxD.dtype)),
      targets_BxT.reshape(B * T), chunk_size, 1.0, compute_entropy, second_temperature)
  return (logp_N.reshape(B, T), entropy_N.reshape(B, T) if compute_entropy else None,
          second_N.reshape(B, T))


def full_logits_logprobs_and_entropy(hidden_BxTxD, unembed_DxV, targets_BxT,
                                     temperature: float = 1.0):
  """The same as `token_logprobs_and_entropy` through full [B, T, V] float32 logits.

  The reference the chunked path is tested and benchmarked against; fine for small V.
  """
  logits = jnp.einsum("btd,dv->btv", hidden_BxTxD, unembed_DxV.astype(hidden_BxTxD.dtype),
                      preferred_element_type=jnp.float32) / temperature
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all, targets_BxT[..., None], axis=-1)[..., 0]
  return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


def sequence_logprobs(cfg, params, tokens_BxT, valid_BxT=None, *, chunk_size: int = 1024,
                      temperature: float = 1.0, compute_entropy: bool = True):
  """Log-probs (and entropies) of each token given the tokens before it.

  Column t scores token t from the logits at position t-1; column 0 is 0. Mask with the
  response positions (valid response tokens, EOS included) to get a response's terms.

  Returns:
    (logp_BxT float32, entropy_BxT float32 or None), aligned with `tokens_BxT`.
  """
  hidden_BxTxD, _ = models.apply(cfg, params, tokens_BxT, valid_BxT, return_hidden=True)
  logp, entropy = token_logprobs_and_entropy(
      hidden_BxTxD[:, :-1], models.unembedding(cfg, params), tokens_BxT[:, 1:],
      chunk_size=chunk_size, temperature=temperature, compute_entropy=compute_entropy)
  shift = functools.partial(jnp.pad, pad_width=((0, 0), (1, 0)))
  return shift(logp), None if entropy is None else shift(entropy)
