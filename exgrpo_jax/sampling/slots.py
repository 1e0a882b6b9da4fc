"""The device programs of continuous batching (`continuous`): empty, admit, resume, place,
repage, select, decode, release.

The keys and values of every slot's row live in one pool of P pages of T slots
(`decode_layer.Paged`), per layer a (k_PxKxDhxT, v_PxKxTxDh) pair or, on TPU, one array
in the paged-attention kernel's layout (`paged_kernel`; `empty` chooses, the other
programs follow the pool they are given). A row addresses its cache by position: its
prompt from address 0 (`place` drops the prompt's left padding), then its step-t
key/value at address prompt length + t; address a lies in the row's page `a // T` (the
host's page table, `pages.PageTable`, says which pool page that is), at slot `a % T`.
The row attends to its addresses up to its newest token (`attended`), on its own pages
only. The host sizes XLA's pool between chunks (`repage`; the kernel's has one size)
and passes the page table and each page's owner and first address to every decode
chunk.
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp

from exgrpo_jax import models
from exgrpo_jax import sharding
from exgrpo_jax.models import config as config_lib
from exgrpo_jax.sampling import categorical
from exgrpo_jax.sampling import decode
from exgrpo_jax.sampling import decode_layer
from exgrpo_jax.sampling import paged_kernel


@flax.struct.dataclass
class Slots:
  """The device state of B decode slots and their page pool."""

  caches: tuple  # per layer (k_PxKxDhxT, v_PxKxTxDh) or (kv_PxTxCxDh,): the page pool
  logits_BxV: jax.Array  # next-token logits
  keys_B: jax.Array  # fold_in(key, r) of the slot's row r
  steps_B: jax.Array  # tokens the row has emitted (next key/value: address prompt + steps)
  prompt_len_B: jax.Array  # the row's real prompt tokens (position of its first new token)
  done_B: jax.Array


@flax.struct.dataclass
class Admitted:
  """The prompt state of A rows, as `admit` hands it to `place`."""

  caches: tuple  # per layer (k_AxKxDhxL, v_AxKxLxDh)
  logits_AxV: jax.Array
  prompt_len_A: jax.Array


@functools.partial(jax.jit, static_argnames=(
    "cfg", "slots", "pages", "page_size", "prompt_len", "kernel", "mesh"))
def empty(cfg, params, key, *, slots: int, pages: int, page_size: int, prompt_len: int,
          kernel: bool = False, mesh=None):
  """All-done slots with an empty pool of `pages` pages (in the kernel's layout when
  `kernel`: `paged_kernel.wanted`), and an empty carry (the last prefilled prompt, see
  `admit`)."""
  B, K, Dh = slots, cfg.num_kv_heads, cfg.head_dim
  dt = config_lib.dtype_from_name(cfg.dtype)
  vocab = params["embed"].shape[0]
  layer = (lambda: paged_kernel.empty_layer(pages, page_size, K, Dh, dt)) if kernel else (
      lambda: (jnp.zeros((pages, K, Dh, page_size), dt),
               jnp.zeros((pages, K, page_size, Dh), dt)))
  state = Slots(
      caches=tuple(layer() for _ in range(cfg.num_layers)),
      logits_BxV=jnp.zeros((B, vocab), jnp.float32), keys_B=jax.random.split(key, B),
      steps_B=jnp.zeros((B,), jnp.int32), prompt_len_B=jnp.zeros((B,), jnp.int32),
      done_B=jnp.ones((B,), bool))
  if mesh is not None:
    state = _constrain(state.replace(caches=()), mesh).replace(
        caches=_constrain_pool(state.caches, mesh))
  return state, (jnp.zeros((1, vocab), jnp.float32),
                 models.KVCache.zeros(cfg, 1, prompt_len))


def _constrain(tree, mesh):
  """`tree` with every array split over the mesh's batch axes."""
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
      x, sharding.batch_sharding(mesh, x.shape)), tree)


def _pool_specs(layer, mesh):
  """A pool layer's specs: pages over the batch axes and KV heads over `tensor`, as the
  decode step's queries are by head (split by page alone, every tensor shard would hold
  all KV heads: 4x the pool per device at tensor = 4). A row's pages are on its slot's
  device (`pages.PageTable`), which the kernel reads them on."""
  if len(layer) == 1:
    return (paged_kernel.pool_spec(mesh, layer[0].shape),)
  return tuple(sharding.spec(("batch", "kv_heads", None, None), x.shape, mesh) for x in layer)


def _constrain_pool(layers, mesh):
  """Pool layers split as `_pool_specs` says."""
  return tuple(tuple(jax.lax.with_sharding_constraint(x, sharding.NamedSharding(mesh, s))
                     for x, s in zip(layer, _pool_specs(layer, mesh)))
               for layer in layers)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("carry",))
def admit(cfg, params, layers, carry, prompt_PxL, valid_PxL, source_A, carry_source):
  """The prompt state of A rows, then the new carry: returns (Admitted, carry).

  `params` without their stacked layers and `layers`, `prepare_layers`' (`decode.prefill`).

  Row a continues source `source_A[a]`: 0 is the carry (the last prefilled prompt), j > 0
  is the (j-1)-th of the P prompts prefilled here (P may be 0). The new carry is source
  `carry_source`. Independent of the page pool, so it compiles once per P.
  """
  carry_logits_1xV, carry_cache = carry
  logits_QxV, k_LxQ, v_LxQ, valid_QxL = (carry_logits_1xV, carry_cache.k_LxBxKxDhxS,
                                         carry_cache.v_LxBxKxSxDh, carry_cache.valid_BxS)
  if prompt_PxL.shape[0]:
    logits_PxV, cache = decode.prefill(cfg, params, prompt_PxL, valid_PxL, layers)
    logits_QxV = jnp.concatenate([logits_QxV, logits_PxV])
    k_LxQ = jnp.concatenate([k_LxQ, cache.k_LxBxKxDhxS], axis=1)
    v_LxQ = jnp.concatenate([v_LxQ, cache.v_LxBxKxSxDh], axis=1)
    valid_QxL = jnp.concatenate([valid_QxL, cache.valid_BxS])
  rows = Admitted(
      caches=tuple((k_LxQ[i, source_A], v_LxQ[i, source_A]) for i in range(k_LxQ.shape[0])),
      logits_AxV=logits_QxV[source_A],
      prompt_len_A=jnp.sum(valid_QxL[source_A], axis=1, dtype=jnp.int32))
  carry_cache = carry_cache.replace(
      k_LxBxKxDhxS=jax.lax.dynamic_slice_in_dim(k_LxQ, carry_source, 1, axis=1),
      v_LxBxKxSxDh=jax.lax.dynamic_slice_in_dim(v_LxQ, carry_source, 1, axis=1),
      valid_BxS=jax.lax.dynamic_slice_in_dim(valid_QxL, carry_source, 1))
  return rows, (jax.lax.dynamic_slice_in_dim(logits_QxV, carry_source, 1), carry_cache)


@functools.partial(jax.jit, static_argnames=("cfg",))
def resume(cfg, params, layers, seq_AxM, valid_AxM):
  """The state of A preempted rows, as `admit` hands rows to `place`: each row's prompt
  and the tokens it had emitted (left-padded to M) run through the model again, so its
  cache holds every address up to its newest token and its logits predict the next."""
  logits_AxV, cache = decode.prefill(cfg, params, seq_AxM, valid_AxM, layers)
  return Admitted(
      caches=tuple((cache.k_LxBxKxDhxS[i], cache.v_LxBxKxSxDh[i])
                   for i in range(cfg.num_layers)),
      logits_AxV=logits_AxV, prompt_len_A=jnp.sum(valid_AxM, axis=1, dtype=jnp.int32))


@functools.partial(jax.jit, donate_argnames=("slots",))
def place(slots: Slots, rows: Admitted, slot_A, pages_AxN, keys_A, steps_A):
  """Puts `admit`'s or `resume`'s rows into slots `slot_A` (B: no row), their tokens
  into pages `pages_AxN` (the pool pages of addresses 0 .. N*T - 1; P: no page). Row a
  has emitted `steps_A[a]` of its tokens already (a resumed row): its prompt is its
  first prompt_len_A - steps_A tokens, and it draws its next token with step key
  steps_A[a], as it would have without the preemption."""
  A, L = rows.caches[0][0].shape[0], rows.caches[0][0].shape[-1]
  kernel = len(slots.caches[0]) == 1
  T = slots.caches[0][0].shape[1 if kernel else -1]
  N = pages_AxN.shape[1]
  # Prompts come left-padded to L; at address 0 is each row's first prompt token.
  pad_A = L - rows.prompt_len_A
  unpad = lambda x, axis: jax.vmap(lambda x, n: jnp.roll(x, -n, axis=axis - 1))(x, pad_A)

  def paged(x, axis):  # [A, ..., L, ...] -> [A * N, ..., T, ...], L padded to N * T
    x = jnp.pad(unpad(x, axis), [(0, N * T - L if a == axis else 0) for a in range(x.ndim)])
    x = x.reshape(*x.shape[:axis], N, T, *x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 1).reshape(A * N, *x.shape[1:axis], T, *x.shape[axis + 2:])

  put_pages = lambda pool, new: pool.at[pages_AxN.reshape(-1)].set(new, mode="drop")
  if kernel:
    caches = tuple((put_pages(kv, paged(paged_kernel.combine(k_new, v_new), 1)),)
                   for (kv,), (k_new, v_new) in zip(slots.caches, rows.caches))
  else:
    caches = tuple((put_pages(k, paged(k_new, 3)), put_pages(v, paged(v_new, 2)))
                   for (k, v), (k_new, v_new) in zip(slots.caches, rows.caches))
  put = lambda x, value: x.at[slot_A].set(value, mode="drop")
  return slots.replace(
      caches=caches, logits_BxV=put(slots.logits_BxV, rows.logits_AxV),
      keys_B=put(slots.keys_B, keys_A), steps_B=put(slots.steps_B, steps_A),
      prompt_len_B=put(slots.prompt_len_B, rows.prompt_len_A - steps_A),
      done_B=put(slots.done_B, False))


def repage(compiled, caches: list, source_Q, mesh=None) -> None:
  """Gives the pool in `caches` (its layers, replaced in place) Q pages: page q is the
  old page `source_Q[q]`, or a free one where that is out of range (the host's
  compaction or growth; `repage_layer`). `compiled` is the engine's program cache.

  One layer at a time, each old layer dropped as soon as its new one is made: the device
  holds the new pool and one old layer, not both pools, which one program over the whole
  pool would (XLA keeps a program's arguments to its end; on the largest growth that is
  1.9x the cache the static loop holds).
  """
  run = compiled(repage_layer, (caches[0], source_Q), dict(mesh=mesh), takes_cfg=False)
  for i in range(len(caches)):  # the list holds each old layer's last reference
    caches[i] = run(caches[i], source_Q)


@functools.partial(jax.jit, static_argnames=("mesh",))
def repage_layer(layer, source_Q, *, mesh=None):
  """One layer's pages, in `repage`'s new order, a new page zeros (XLA's layout: the TPU
  kernel's pool has one size, `pages.ladder`, and never moves).

  On a mesh each device moves its own pages, inside `shard_map`: a page never changes
  devices (`pages.PageTable`), and XLA's own gather over a pool split by page went
  through a temporary of 4.5 to 9.75 times the new layer on TPU, and on 8 H100s of 7.88
  GiB for Qwen2.5-Math-1.5B at 1024 rows (the program's peak 9.99 GiB, 2.11 now)."""
  old = layer[0].shape[0]

  def move(source_Q, *layer):  # pool page numbers -> this device's
    local = layer[0].shape[0]
    index_Q = jnp.where(source_Q < old, source_Q % local, local)
    return tuple(jnp.take(x, index_Q, axis=0, mode="fill", fill_value=0) for x in layer)

  if mesh is None:
    return move(source_Q, *layer)
  specs = _pool_specs(layer, mesh)
  pages = sharding.spec(("batch",), source_Q.shape, mesh)
  return jax.shard_map(move, mesh=mesh, in_specs=(pages, *specs), out_specs=specs)(
      source_Q, *layer)


@functools.partial(jax.jit, static_argnames=("mesh",))
def select(slots: Slots, keep_C, *, mesh=None):
  """Slots `keep_C` of `slots` (given without its pool, which stays as it is: the host
  renumbers the pages' owners), in that order: C slots, each with its row's state."""
  slots = jax.tree.map(lambda x: x[keep_C], slots)
  return slots if mesh is None else _constrain(slots, mesh)


@functools.partial(jax.jit, donate_argnames=("slots",))
def release(slots: Slots, release_B):
  """Marks the slots in `release_B` done (their rows ended on a stop string)."""
  return slots.replace(done_B=slots.done_B | release_B)


def attended(base_P, owner_P, address_B, page_size: int):
  """[P, T]: the pool slots a row's next step attends to, on the pages it owns: its
  addresses up to its new token's, `address_B`. `base_P` is each page's first address in
  its owner's cache; free pages: none."""
  B = address_B.shape[0]
  address_PxT = base_P[:, None] + jnp.arange(page_size)
  last_Px1 = address_B[jnp.minimum(owner_P, B - 1)][:, None]
  return (address_PxT <= last_Px1) & (owner_P < B)[:, None]


@functools.partial(jax.jit, static_argnames=(
    "cfg", "steps", "max_new_tokens", "top_k", "use_top_p", "return_entropy"),
                   donate_argnames=("slots",))
def decode_chunk(cfg, params, layers, slots: Slots, table_BxN, owner_P, base_P, temperature,
                 top_p, greedy, eos_ids_E, *, steps: int, max_new_tokens: int,
                 top_k: int, use_top_p: bool, return_entropy: bool):
  """Up to `steps` decode steps of every slot (fewer once all are done).

  `table_BxN` holds each slot's pool pages (P where it has none), `owner_P` each page's
  slot (B: free) and `base_P` its first address; the caller gives
  every live row the pages of its next `steps` addresses. Returns (slots, dict of
  tokens_BxC, logprobs_BxC, entropy_BxC (or None): what each slot emitted, from column 0
  until its row ended; steps_B, done_B; taken: how many steps ran).
  """
  B, N = table_BxN.shape
  P = owner_P.shape[0]
  T = slots.caches[0][0].shape[1 if len(slots.caches[0]) == 1 else -1]
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
    address_B = slots.prompt_len_B + slots.steps_B  # its position
    page_B = table_BxN[jnp.arange(B), jnp.minimum(address_B // T, N - 1)]
    paged = decode_layer.Paged(
        page_B=jnp.where(active_B, page_B, P), offset_B=address_B % T, owner_P=owner_P,
        mask_PxT=attended(base_P, owner_P, address_B, T), table_BxN=table_BxN,
        length_B=jnp.where(active_B, address_B + 1, 1))
    steps_B = slots.steps_B + active_B
    done_B = slots.done_B | jnp.isin(token_B, eos_ids_E) | (steps_B >= max_new_tokens)
    logits_BxV, caches = decode.layers_step(cfg, params, layers, slots.caches, paged,
                                            address_B[:, None], None, token_B)
    slots = slots.replace(caches=caches, logits_BxV=logits_BxV, steps_B=steps_B,
                          done_B=done_B)
    return i + 1, slots, tokens_BxC, logp_BxC, ent_BxC

  zeros = lambda dtype: jnp.zeros((B, steps), dtype)
  state = (jnp.int32(0), slots, zeros(jnp.int32), zeros(jnp.float32),
           zeros(jnp.float32) if return_entropy else None)
  taken, slots, tokens_BxC, logp_BxC, ent_BxC = jax.lax.while_loop(
      lambda s: (s[0] < steps) & ~jnp.all(s[1].done_B), body, state)
  return slots, dict(tokens_BxC=tokens_BxC, logprobs_BxC=logp_BxC, entropy_BxC=ent_BxC,
                     steps_B=slots.steps_B, done_B=slots.done_B, taken=taken)


prepare_layers = jax.jit(decode.prepare_layers, static_argnums=0)
