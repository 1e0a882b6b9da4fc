"""The jitted generation core: prefill a left-padded prompt batch, then a decode loop.

`generate` is one XLA program. Prompts are prefilled once each through the model's
layers into a `KVCache` (`prefill`; rows that share a prompt, the n samples of a GRPO
group, copy its cache instead of recomputing it), then a `lax.while_loop` samples one
token per row per step and feeds it back through the model, until every row has emitted
an EOS id or `max_new_tokens` is reached. All shapes are static: the caller buckets the
batch and prompt length, so a training run compiles a handful of programs; the
parameters are an ordinary argument, so new weights never cause a recompile.

The decode step runs the model's layers, unrolled, on per-layer weights (cut, cast and
rearranged once per call by their own program, `prepare_layers`: `decode_layer`) and
per-layer caches, instead of the layer scan
`models.apply` uses: inside a scan XLA copies every layer's weights and cache out of the
stacked arrays and rebuilds the whole stacked cache on every step (for SmolLM2 at batch
64 on CPU that made a step take ~4x its matmul time), while here each layer's cache is
updated in place and read once per step. The price is a longer compile (the layer body
is traced L times: ~12 s for SmolLM2's 30 layers on 2 CPU cores).

Every step attends to all the cache's slots (masked where empty), so a cache sized for
the whole rollout from the first step makes early steps pay for slots not yet written.
Long rollouts therefore grow the cache in phases (`phases_for`): the loop runs once per
phase with the cache extended by that phase's slots. With 4 phases a step attends on
average to L + 5N/8 slots instead of L + N, at the price of one loop body to compile
per phase.
"""

import functools

import jax
import jax.numpy as jnp

from exgrpo_jax import models
from exgrpo_jax.models import attention as attention_lib
from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import transformer
from exgrpo_jax.sampling import categorical
from exgrpo_jax.sampling import decode_layer

# Rollouts of at least _LONG_ROLLOUT new tokens decode in _PHASES phases (`generate`):
# shorter ones would pay more in compile time (a loop body per phase) than they save.
_LONG_ROLLOUT = 512
_PHASES = 4


def _last_logits(cfg, params, hidden_BxD):
  """The LM head on one position, computed exactly as the model computes its logits."""
  dt = config_lib.dtype_from_name(cfg.dtype)
  return jnp.einsum("bd,dv->bv", hidden_BxD, models.unembedding(cfg, params).astype(dt),
                    preferred_element_type=jnp.float32)


def _split_rows(cache: models.KVCache, row_prompt_B: jax.Array):
  """Per-layer (k, v) caches of each row's prompt, from the stacked prompt cache."""
  take = lambda x: jnp.take(x, row_prompt_B, axis=0)
  return tuple((take(cache.k_LxBxKxDhxS[i]), take(cache.v_LxBxKxSxDh[i]))
               for i in range(cache.k_LxBxKxDhxS.shape[0]))


def prefill(cfg, params, prompt_PxL, valid_PxL, layers):
  """Runs P left-padded prompts through the model; returns (next-token logits_PxV, KVCache).

  The cache holds the prompts' L slots only: decoding adds its slots when each row's cache
  is copied out, so the prefill's cost does not grow with the rollout length. The layers
  run on `layers` (`prepare_layers`' weights), unrolled, each through the model's own
  layer (`decode_layer.unprepare`): `models.apply` with a cache, but params["layers"] is
  not read, so the engine keeps one copy of the weights beside its cache, not two.
  """
  dt = config_lib.dtype_from_name(cfg.dtype)
  cache = models.KVCache.zeros(cfg, *prompt_PxL.shape)
  valid_PxS, positions_PxL = transformer.cache_positions(cache.valid_BxS, cache.index,
                                                         valid_PxL)
  mask = attention_lib.AttentionMask.padded(valid_PxS, cache.index)
  x_PxLxD = jnp.take(params["embed"], prompt_PxL, axis=0).astype(dt)
  new_kv = []
  for i, w in enumerate(layers):
    x_PxLxD, kv = transformer.DecoderLayer(cfg).apply(
        {"params": decode_layer.unprepare(cfg, w)}, x_PxLxD,
        (cache.k_LxBxKxDhxS[i], cache.v_LxBxKxSxDh[i], cache.index), positions_PxL, mask)
    new_kv.append(kv)
  h_PxLxD = transformer.RMSNorm(cfg).apply({"params": params["final_norm"]}, x_PxLxD)
  k_LxPxKxDhxS, v_LxPxKxSxDh = (jnp.stack(x) for x in zip(*new_kv))
  cache = models.KVCache(k_LxPxKxDhxS, v_LxPxKxSxDh, valid_PxS,
                         cache.index + prompt_PxL.shape[1])
  return _last_logits(cfg, params, h_PxLxD[:, -1]), cache


def prepare_layers(cfg, params):
  """Every layer's weights in `decode_layer.step`'s form (a list, one entry per layer)."""
  return [decode_layer.prepare(cfg, jax.tree.map(lambda p, i=i: p[i], params["layers"]))
          for i in range(cfg.num_layers)]


def layers_step(cfg, params, layers, caches, index, positions_Bx1, mask_Bx1xS, token_B):
  """One token per row through the unrolled layers, its k/v written at cache slot `index`
  (or the page pool's slots, `decode_layer.Paged`); returns (next-token logits_BxV,
  caches)."""
  dt = config_lib.dtype_from_name(cfg.dtype)
  x_BxD = jnp.take(params["embed"], token_B, axis=0).astype(dt)
  new_caches = []
  for w, cache in zip(layers, caches):
    x_BxD, kv = decode_layer.step(cfg, w, x_BxD, (*cache, index), positions_Bx1,
                                  mask_Bx1xS)
    new_caches.append(kv)
  h_BxD = transformer.RMSNorm(cfg).apply({"params": params["final_norm"]}, x_BxD)
  return _last_logits(cfg, params, h_BxD), tuple(new_caches)


def _decode_step(cfg, params, layers, caches, valid_BxS, index, token_B):
  """`layers_step` at the same slot for every row; returns (logits, caches, valid)."""
  valid_BxS, positions_Bx1, mask_Bx1xS = transformer.cache_positions_and_mask(
      valid_BxS, index, jnp.ones((token_B.shape[0], 1), bool))
  logits_BxV, caches = layers_step(cfg, params, layers, caches, index, positions_Bx1,
                                   mask_Bx1xS, token_B)
  return logits_BxV, caches, valid_BxS


def bucket(n: int) -> int:
  """Power of two up to 64, then the next multiple of 64 (batch shapes of the engine)."""
  return 1 << max(n - 1, 0).bit_length() if n <= 64 else -(-n // 64) * 64


def length_bucket(n: int, minimum: int) -> int:
  """n rounded up to a multiple of max(minimum, next power of two / 8): 4 lengths per
  doubling, under 1/4 of padding (prompt lengths; a preempted row's tokens)."""
  step = max(minimum, (1 << max(n - 1, 0).bit_length()) // 8)
  return -(-n // step) * step


def phases_for(max_new_tokens: int) -> int:
  """How many phases the decode loop's cache grows in (see `generate`)."""
  return 1 if max_new_tokens < _LONG_ROLLOUT else _PHASES


def phase_ends(max_new_tokens: int, phases: int) -> list[int]:
  """The decode steps at which each phase ends: its cache holds L + that many slots."""
  return [-(-max_new_tokens * (k + 1) // phases) for k in range(phases)]


def _pad_slots(caches, valid_BxS, slots: int):
  """`slots` more (empty, masked) cache slots at the end of every layer's k/v cache."""
  pad = lambda x, axis: jnp.pad(x, [(0, slots if a == axis else 0) for a in range(x.ndim)])
  return (tuple((pad(k, 3), pad(v, 2)) for k, v in caches), pad(valid_BxS, 1))


@functools.partial(jax.jit, static_argnames=(
    "cfg", "max_new_tokens", "top_k", "use_top_p", "return_entropy", "phases"))
def generate(cfg, params, layers, prompt_PxL, valid_PxL, row_prompt_B, live_B, keys_B,
             temperature, top_p, greedy, eos_ids_E, *, max_new_tokens: int, top_k: int,
             use_top_p: bool, return_entropy: bool, phases: int = 1):
  """Samples up to `max_new_tokens` tokens for every row.

  Args:
    cfg: the (static, hashable) ModelConfig.
    params: model parameters; their stacked layers are not read.
    layers: every layer's weights in the decode step's form (`prepare_layers`, run as a
      program of its own: inside this one its 2/3 of the weights were one more
      temporary, which on CPU meant fresh pages to fault in on every call).
    prompt_PxL, valid_PxL: P left-padded prompts of bucketed length L and their mask.
    row_prompt_B: int32, which prompt each of the B rows continues.
    live_B: bool, False on padding rows (they stop at once and emit nothing).
    keys_B: one PRNG key per row; the row's step-t key is fold_in(keys_B[row], t).
    temperature, top_p, greedy: scalars (traced: changing them does not recompile).
    eos_ids_E: int32 ids that end a row (emitted and counted in its length).
    max_new_tokens, top_k, use_top_p, return_entropy: static options, see
      `categorical.choose_tokens`.
    phases: static; the decode loop runs in this many phases of about N / phases steps,
      and the cache holds only the slots written so far plus the current phase's, so
      early steps attend to fewer slots. Each phase compiles its own loop body.

  Returns:
    dict of tokens_BxN (int32; 0 after the end), logprobs_BxN (0 after the end),
    entropy_BxN (or None), lengths_B (tokens emitted, EOS included) and eos_B (whether
    the row ended on an EOS id).
  """
  B, N = row_prompt_B.shape[0], max_new_tokens
  L = prompt_PxL.shape[1]
  logits_PxV, cache = prefill(cfg, params, prompt_PxL, valid_PxL, layers)
  logits_BxV = jnp.take(logits_PxV, row_prompt_B, axis=0)
  caches = _split_rows(cache, row_prompt_B)
  valid_BxS = jnp.take(cache.valid_BxS, row_prompt_B, axis=0)
  choose = functools.partial(categorical.choose_tokens, top_k=top_k, use_top_p=use_top_p,
                             return_entropy=return_entropy)

  def cond(end):
    return lambda state: (state[0] < end) & ~jnp.all(state[4])

  def emit(state, logits_BxV):
    """Chooses and records every row's step-t token from `logits_BxV`."""
    t, caches, valid_BxS, _, done_B, lengths_B, tokens_BxN, logp_BxN, ent_BxN = state
    step_keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, t)
    token_B, logp_B, ent_B = choose(logits_BxV, step_keys_B, temperature, top_p, greedy)
    active_B = ~done_B
    token_B = jnp.where(active_B, token_B, 0)
    tokens_BxN = jax.lax.dynamic_update_slice_in_dim(tokens_BxN, token_B[:, None], t, 1)
    logp_BxN = jax.lax.dynamic_update_slice_in_dim(
        logp_BxN, jnp.where(active_B, logp_B, 0.0)[:, None], t, 1)
    if ent_BxN is not None:
      ent_BxN = jax.lax.dynamic_update_slice_in_dim(
          ent_BxN, jnp.where(active_B, ent_B, 0.0)[:, None], t, 1)
    lengths_B = jnp.where(active_B, t + 1, lengths_B)
    done_B = done_B | jnp.isin(token_B, eos_ids_E)
    return (t + 1, caches, valid_BxS, token_B, done_B, lengths_B, tokens_BxN, logp_BxN,
            ent_BxN)

  def body(state):
    # The previous token's step first: none runs after the last token is chosen.
    t, caches, valid_BxS, token_B, *rest = state
    logits_BxV, caches, valid_BxS = _decode_step(cfg, params, layers, caches, valid_BxS,
                                                 L + t - 1, token_B)
    return emit((t, caches, valid_BxS, token_B, *rest), logits_BxV)

  state = emit((jnp.int32(0), caches, valid_BxS, None, ~live_B, jnp.zeros((B,), jnp.int32),
                jnp.zeros((B, N), jnp.int32), jnp.zeros((B, N), jnp.float32),
                jnp.zeros((B, N), jnp.float32) if return_entropy else None), logits_BxV)
  start = 0
  for end in phase_ends(N, phases):
    t, caches, valid_BxS, *rest = state
    state = (t, *_pad_slots(caches, valid_BxS, end - start), *rest)
    state = jax.lax.while_loop(cond(end), body, state)
    start = end
  _, _, _, _, done_B, lengths_B, tokens_BxN, logp_BxN, ent_BxN = state
  # A live row is done only once it has emitted an EOS id.
  return dict(tokens_BxN=tokens_BxN, logprobs_BxN=logp_BxN, entropy_BxN=ent_BxN,
              lengths_B=lengths_B, eos_B=live_B & done_B)
