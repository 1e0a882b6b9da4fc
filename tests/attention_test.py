"""Attention: packed rows (segment ids, per-segment positions) against separate sequences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exgrpo_jax import models

LLAMA = models.ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2,
                           num_heads=6, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
QWEN2 = LLAMA.replace(model_type="qwen2", attention_bias=True, num_heads=8, num_kv_heads=1,
                      rope_theta=1e6, tie_word_embeddings=True)


def random_params(cfg, seed=0):
  """Init params with every leaf (biases and norms too) randomised."""
  params = models.init_params(cfg, jax.random.key(seed))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree.unflatten(treedef, [
      x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


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
