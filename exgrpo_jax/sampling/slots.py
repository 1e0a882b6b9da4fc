"""The device programs of continuous batching (`continuous`): empty, admit, place, resize,
select, decode, release.

A slot's KV cache holds L prompt slots (left-padded, as in the static loop) and a decode
window of W slots: its row writes its step-t key/value at slot L + t, as the static loop
does, so the window must cover the oldest live row (`continuous` picks W, one of a few
sizes, and `resize` changes it between chunks).
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp

from exgrpo_jax import models
from exgrpo_jax import sharding
from exgrpo_jax.sampling import categorical
from exgrpo_jax.sampling import decode


@flax.struct.dataclass
class Slots:
  """The device state of B decode slots. S = L prompt slots + a window of W decode slots."""

  caches: tuple  # per layer (k_BxKxDhxS, v_BxKxSxDh)
  valid_BxS: jax.Array  # which cache slots the slot's current row attends to
  logits_BxV: jax.Array  # next-token logits
  keys_B: jax.Array  # fold_in(key, r) of the slot's row r
  steps_B: jax.Array  # tokens the row has emitted (its next key/value goes to slot L + steps)
  prompt_len_B: jax.Array  # the row's real prompt tokens (position of its first new token)
  done_B: jax.Array


@flax.struct.dataclass
class Admitted:
  """The prompt state of A rows, as `admit` hands it to `place`."""

  caches: tuple  # per layer (k_AxKxDhxL, v_AxKxLxDh)
  valid_AxL: jax.Array
  logits_AxV: jax.Array
  prompt_len_A: jax.Array


@functools.partial(jax.jit, static_argnames=("cfg", "slots", "prompt_len", "width", "mesh"))
def empty(cfg, params, key, *, slots: int, prompt_len: int, width: int, mesh=None):
  """All-done slots with a `width`-slot decode window, and an empty carry (the last
  prefilled prompt, see `admit`)."""
  L, B = prompt_len, slots
  cache = models.KVCache.zeros(cfg, B, L + width)
  vocab = params["embed"].shape[0]
  state = Slots(
      caches=tuple(zip(cache.k_LxBxKxDhxS, cache.v_LxBxKxSxDh)), valid_BxS=cache.valid_BxS,
      logits_BxV=jnp.zeros((B, vocab), jnp.float32), keys_B=jax.random.split(key, B),
      steps_B=jnp.zeros((B,), jnp.int32), prompt_len_B=jnp.zeros((B,), jnp.int32),
      done_B=jnp.ones((B,), bool))
  if mesh is not None:
    state = _constrain(state, mesh)
  return state, (jnp.zeros((1, vocab), jnp.float32), models.KVCache.zeros(cfg, 1, L))


def _constrain(state: Slots, mesh) -> Slots:
  """`state` with every array split over the mesh's batch axes."""
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
      x, sharding.batch_sharding(mesh, x.shape)), state)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("carry",))
def admit(cfg, params, carry, prompt_PxL, valid_PxL, source_A, carry_source):
  """The prompt state of A rows, then the new carry: returns (Admitted, carry).

  Row a continues source `source_A[a]`: 0 is the carry (the last prefilled prompt), j > 0
  is the (j-1)-th of the P prompts prefilled here (P may be 0). The new carry is source
  `carry_source`. Independent of the slots' window, so it compiles once per P.
  """
  carry_logits_1xV, carry_cache = carry
  logits_QxV, k_LxQ, v_LxQ, valid_QxL = (carry_logits_1xV, carry_cache.k_LxBxKxDhxS,
                                         carry_cache.v_LxBxKxSxDh, carry_cache.valid_BxS)
  if prompt_PxL.shape[0]:
    logits_PxV, cache = decode.prefill(cfg, params, prompt_PxL, valid_PxL)
    logits_QxV = jnp.concatenate([logits_QxV, logits_PxV])
    k_LxQ = jnp.concatenate([k_LxQ, cache.k_LxBxKxDhxS], axis=1)
    v_LxQ = jnp.concatenate([v_LxQ, cache.v_LxBxKxSxDh], axis=1)
    valid_QxL = jnp.concatenate([valid_QxL, cache.valid_BxS])
  valid_AxL = valid_QxL[source_A]
  rows = Admitted(
      caches=tuple((k_LxQ[i, source_A], v_LxQ[i, source_A]) for i in range(k_LxQ.shape[0])),
      valid_AxL=valid_AxL, logits_AxV=logits_QxV[source_A],
      prompt_len_A=jnp.sum(valid_AxL, axis=1, dtype=jnp.int32))
  carry_cache = carry_cache.replace(
      k_LxBxKxDhxS=jax.lax.dynamic_slice_in_dim(k_LxQ, carry_source, 1, axis=1),
      v_LxBxKxSxDh=jax.lax.dynamic_slice_in_dim(v_LxQ, carry_source, 1, axis=1),
      valid_BxS=jax.lax.dynamic_slice_in_dim(valid_QxL, carry_source, 1))
  return rows, (jax.lax.dynamic_slice_in_dim(logits_QxV, carry_source, 1), carry_cache)


@functools.partial(jax.jit, donate_argnames=("slots",))
def place(slots: Slots, rows: Admitted, slot_A, keys_A):
  """Puts `admit`'s rows into slots `slot_A` (B: no row), their windows empty."""
  L = rows.valid_AxL.shape[1]
  W = slots.valid_BxS.shape[1] - L
  put = lambda x, value: x.at[slot_A].set(value, mode="drop")
  caches = tuple((k.at[slot_A, :, :, :L].set(k_new, mode="drop"),
                  v.at[slot_A, :, :L].set(v_new, mode="drop"))
                 for (k, v), (k_new, v_new) in zip(slots.caches, rows.caches))
  return Slots(
      caches=caches, valid_BxS=put(slots.valid_BxS, jnp.pad(rows.valid_AxL, ((0, 0), (0, W)))),
      logits_BxV=put(slots.logits_BxV, rows.logits_AxV), keys_B=put(slots.keys_B, keys_A),
      steps_B=put(slots.steps_B, 0), prompt_len_B=put(slots.prompt_len_B, rows.prompt_len_A),
      done_B=put(slots.done_B, False))


@functools.partial(jax.jit, static_argnames=("size", "mesh"))
def resize(slots: Slots, *, size: int, mesh=None):
  """The slots with `size` cache slots (L + the new window): cut (the slots beyond it
  hold no live row's keys) or padded with empty slots."""
  fit = lambda x, axis: (jax.lax.slice_in_dim(x, 0, size, axis=axis) if size <= x.shape[axis]
                         else jnp.pad(x, [(0, size - x.shape[axis] if a == axis else 0)
                                          for a in range(x.ndim)]))
  slots = slots.replace(caches=tuple((fit(k, 3), fit(v, 2)) for k, v in slots.caches),
                        valid_BxS=fit(slots.valid_BxS, 1))
  return slots if mesh is None else _constrain(slots, mesh)


@functools.partial(jax.jit, static_argnames=("mesh",))
def select(slots: Slots, keep_C, *, mesh=None):
  """Slots `keep_C` of `slots`, in that order: C slots, each with its row's state."""
  slots = jax.tree.map(lambda x: x[keep_C], slots)
  return slots if mesh is None else _constrain(slots, mesh)


@functools.partial(jax.jit, donate_argnames=("slots",))
def release(slots: Slots, release_B):
  """Marks the slots in `release_B` done (their rows ended on a stop string)."""
  return slots.replace(done_B=slots.done_B | release_B)


@functools.partial(jax.jit, static_argnames=(
    "cfg", "steps", "max_new_tokens", "top_k", "use_top_p", "return_entropy"),
                   donate_argnames=("slots",))
def decode_chunk(cfg, params, layers, slots: Slots, prompt_len, temperature, top_p, greedy,
                 eos_ids_E, *, steps: int, max_new_tokens: int, top_k: int, use_top_p: bool,
                 return_entropy: bool):
  """Up to `steps` decode steps of every slot (fewer once all are done).

  `prompt_len` is L (traced: the window's size is the cache's). The caller makes the
  window hold every live row's next `steps` keys. Returns (slots, dict of tokens_BxC,
  logprobs_BxC, entropy_BxC (or None): what each slot emitted, from column 0 until its
  row ended; steps_B, done_B; taken: how many steps ran).
  """
  B, S = slots.valid_BxS.shape
  choose = functools.partial(categorical.choose_tokens, top_k=top_k, use_top_p=use_top_p,
                             return_entropy=return_entropy)

  def body(state):
    i, slots, tokens_BxC, logp_BxC, ent_BxC = state
    step_keys_B = jax.vmap(jax.random.fold_in)(slots.keys_B, slots.steps_B)
    token_B, logp_B, ent_B = choose(slots.logits_BxV, step_keys_B, temperature, top_p, greedy)
    active_B = ~slots.done_B
    token_B = jnp.where(active_B, token_B, 0)
    put = lambda x_BxC, value_B: jax.lax.dynamic_update_slice_in_dim(
        x_BxC, jnp.where(active_B, value_B, 0)[:, None], i, 1)
    tokens_BxC, logp_BxC = put(tokens_BxC, token_B), put(logp_BxC, logp_B)
    if ent_BxC is not None:
      ent_BxC = put(ent_BxC, ent_B)
    positions_Bx1 = (slots.prompt_len_B + slots.steps_B)[:, None]
    index_B = jnp.where(active_B, prompt_len + slots.steps_B, S)  # S: done rows write nothing
    steps_B = slots.steps_B + active_B
    done_B = slots.done_B | jnp.isin(token_B, eos_ids_E) | (steps_B >= max_new_tokens)
    valid_BxS = slots.valid_BxS.at[jnp.arange(B), index_B].set(True, mode="drop")
    logits_BxV, caches = decode.layers_step(cfg, params, layers, slots.caches, index_B,
                                            positions_Bx1, valid_BxS[:, None, :], token_B)
    slots = slots.replace(caches=caches, valid_BxS=valid_BxS, logits_BxV=logits_BxV,
                          steps_B=steps_B, done_B=done_B)
    return i + 1, slots, tokens_BxC, logp_BxC, ent_BxC

  zeros = lambda dtype: jnp.zeros((B, steps), dtype)
  state = (jnp.int32(0), slots, zeros(jnp.int32), zeros(jnp.float32),
           zeros(jnp.float32) if return_entropy else None)
  taken, slots, tokens_BxC, logp_BxC, ent_BxC = jax.lax.while_loop(
      lambda s: (s[0] < steps) & ~jnp.all(s[1].done_B), body, state)
  return slots, dict(tokens_BxC=tokens_BxC, logprobs_BxC=logp_BxC, entropy_BxC=ent_BxC,
                     steps_B=slots.steps_B, done_B=slots.done_B, taken=taken)


prepare_layers = jax.jit(decode.prepare_layers, static_argnums=0)
