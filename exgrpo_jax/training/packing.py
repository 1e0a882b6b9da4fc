"""Laying out a mini-batch of responses for the learner.

A mini-batch's objective (SPEC section 2, step 8) is a weighted sum over its response
tokens: the policy loss's aggregation and the entropy bonus's token mean both have
denominators that belong to the whole mini-batch, not to the micro-batch a token lands
in. `token_weights` gives each token its weight in that sum, so micro-batch losses add
up to the mini-batch objective (and their gradients to its gradient) exactly.
"""

import jax.numpy as jnp

from exgrpo_jax import losses


def token_weights(mask_NxR, aggregation: str, norm_len: float):
  """Per-token weights w of `aggregation` over N sequences (one per row, loss tokens in
  `mask_NxR`): `losses.aggregate(l, mask, aggregation, norm_len) == sum(w * l)`."""
  mask_NxR = jnp.asarray(mask_NxR, jnp.float32)
  if aggregation == "token_sum_norm":
    return mask_NxR / norm_len
  if aggregation == "token_mean":
    return mask_NxR / jnp.maximum(mask_NxR.sum(), 1)
  if aggregation == "seq_mean_token_mean":
    tokens_Nx1 = mask_NxR.sum(axis=1, keepdims=True)
    sequences = jnp.maximum((tokens_Nx1 > 0).sum(), 1)
    return mask_NxR / jnp.maximum(tokens_Nx1, 1) / sequences
  raise ValueError(f"unknown loss aggregation {aggregation!r}; known: {losses.AGGREGATIONS}")
