"""Continuous batching: B decode slots, each refilled with the next waiting row when its row ends.

The static loop (`decode.generate`) decodes a batch until its last row ends, so in a
long-tailed rollout most slot-steps go to rows that have already finished. Here a fixed
set of B slots decodes in chunks of `steps` tokens (one jitted program, `decode_chunk`);
between chunks the host hands every slot whose row ended (EOS, a stop string, or
`max_new_tokens`) to the next waiting row, whose prompt `admit` prefills into that slot.
The run ends when every row is done. Rows enter in prompt-major order, so a prompt's rows
are admitted one after another; the last prompt an `admit` prefilled is kept on device
(the carry), and its later rows copy its cache instead of prefilling it again: every
prompt is prefilled once, as in the static loop. Once no row waits, the tail runs in
fewer slots: when the live rows fit into half of them, `slots.select` moves them into
the engine's batch bucket that holds them (`schedule`: a power of two up to 64, per
shard of a mesh's batch axes), so the last long rows stop paying for ended ones.

The KV cache is a pool of pages (`slots`, `pages`). A row addresses its cache by
position (its prompt from 0, then step t at prompt length + t), and its addresses live
on pages of its own:
it gets a page when its next chunk reaches it, gives them all back when it ends, and
attends to its own pages only. A step's attention therefore reads the live rows' keys,
not B times the oldest row's, and a row admitted beside a row at step 900 pays for its
own few pages. Before each chunk the pool becomes the smallest size of its ladder (`pages`) that holds
the next chunk's pages (`slots.repage` moves the pages when that changes).
Row r still draws its step-t token from fold_in(fold_in(key, r), t), so its output
depends neither on its slot nor on its neighbours.

A pool capped below every slot's row at its longest (`capacity`, `rollout.kv_pages`)
admits a waiting row only where its shard has the pages of its next chunk (with
`headroom` of the pool kept free beside running rows), and when a shard cannot hold its
live rows' next chunk, preempts its newest rows (`schedule`): their pages go back,
their tokens stay here, and they wait first in line. A preempted row resumes from one
prefill of its prompt and the tokens it had emitted (`slots.resume`) at its own step
count, so it draws what it would have drawn (docs/sampler_performance.md).

Why the host between chunks rather than one `lax.while_loop` with the refill inside:
the refill needs a prefill, whose size (how many new prompts) varies from refill to
refill, and stop strings are only known to the tokenizer; between chunks both are plain
host decisions with static shapes (prompt counts bucketed to 0, 1, 2, 4, ...
`MAX_PROMPTS`; a few pool sizes), and stop strings free their slot early. The price,
which docs/sampler_performance.md measures, is a host round trip per chunk and up to
`steps` - 1 idle steps of a slot whose row ends inside a chunk.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from exgrpo_jax import sharding
from exgrpo_jax.sampling import decode
from exgrpo_jax.sampling import outputs
from exgrpo_jax.sampling import pages as pages_lib
from exgrpo_jax.sampling import paged_kernel
from exgrpo_jax.sampling import schedule
from exgrpo_jax.sampling import slots as slots_lib

# One `admit` call loads at most MAX_ROWS rows and prefills at most MAX_PROMPTS new
# prompts (bucketed to a power of two, or none when all its rows reuse the carry): a few
# programs to compile, and a refill of one row never pays for a large prefill.
MAX_ROWS = 16
MAX_PROMPTS = 4
# One `resume` call prefills at most MAX_RESUMED preempted rows (or one a batch shard):
# each may be nearly at its longest, and its prefill and cache sit beside the full pool
# (16 rows of 10,240 tokens took 10 GiB a chip for Llama-3.1-8B on a v6e-8).
MAX_RESUMED = 4
# Stop strings are looked for in the text of a row's new tokens plus this many earlier
# ones (a hit is then confirmed on the whole text). A longer stop string is still found
# by `outputs.finalize`; only its slot is not freed early.
_STOP_LOOKBACK = 32
def weights(engine, params) -> tuple[dict, list]:
  """The rollout's weights: `params` without their stacked layers, and the layers in the
  decode step's form (`decode.prepare_layers`), which every program of the rollout reads
  (`slots.admit` and `resume` too, `decode.prefill`). One copy of the layers stays beside
  the page pool, not two: a caller that keeps no other reference to `params` frees their
  stacked layers before the pool is allocated."""
  layers = engine.compiled(slots_lib.prepare_layers, (params,), {})(params)
  return without_layers(params), layers


def without_layers(params: dict) -> dict:
  """`params` but their stacked layers (`weights`)."""
  return {k: v for k, v in params.items() if k != "layers"}


def resume_rows(slots: int, shards: int) -> int:
  """The rows one `resume` call prefills (MAX_RESUMED, or one a batch shard)."""
  return min(max(MAX_RESUMED, shards), slots)


def generate(engine, prompt_ids, prompt_index_R, rows_R, weights_, key, sampling,
             prompt_len, slots: int, page_size: int, capacity: int | None = None,
             headroom: float = 0.0, preempt=None):
  """Decodes rows `rows_R` (global row ids) of prompts `prompt_index_R` in `slots` slots,
  with the model's `weights_` (`weights`).

  `engine` is the calling `JaxEngine` (EOS ids, pad id, tokenizer, chunk length, compiled
  programs and stats); `prompt_len` is the bucketed prompt length L; the KV cache is a
  pool of pages of `page_size` slots, of at most `capacity` pages (None: every slot's row
  at its longest). Below that, a row is admitted only while its shard has the pages for
  its next chunk and `headroom` of the pool to spare, and when a shard runs out, its
  newest rows are preempted (`schedule.Scheduler`). `preempt(chunk, slot_row_B)` (tests) names
  more slots to preempt before a chunk. Returns the raw per-row dict `outputs.finalize`
  takes, as the static loop does.
  """
  R, N, B = len(rows_R), sampling.max_new_tokens, slots
  params, layers = weights_
  mesh = sharding.mesh_of(params)
  put = (lambda x: x) if mesh is None else (
      lambda x: jax.device_put(x, sharding.replicated(mesh)))
  scalars = put((np.float32(sampling.temperature), np.float32(sampling.top_p),
                 np.bool_(sampling.is_greedy), np.asarray(engine.eos_ids, np.int32)))
  options = dict(sampling.program_options(), steps=engine.chunk_steps)
  shards = sharding.batch_shards(mesh)
  kernel = paged_kernel.wanted(engine.program_cfg, mesh, B)
  table = pages_lib.PageTable(B, page_size, prompt_len, N, shards, capacity,
                              kernel=kernel)
  keep_free = table.keep_free(headroom)
  state, carry = engine.compiled(slots_lib.empty, (params, key), dict(
      slots=B, pages=table.pages, page_size=page_size, prompt_len=prompt_len,
      kernel=kernel, mesh=mesh))(params, key)
  prompt_len_R = np.array([len(prompt_ids[p]) for p in prompt_index_R])
  row_keys_R = put(jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
      key, jnp.asarray(rows_R, jnp.uint32)))
  admitter = _Admitter(engine, prompt_ids, prompt_index_R, row_keys_R, weights_, prompt_len,
                       table, put)
  scheduler = schedule.Scheduler(table, prompt_len_R, N, engine.chunk_steps, keep_free)
  lengths_R = scheduler.lengths_R
  tokens_RxN = np.zeros((R, N), np.int32)
  logp_RxN = np.zeros((R, N), np.float32)
  ent_RxN = np.zeros((R, N), np.float32) if sampling.return_entropy else None
  chunk = 0
  while (plan := scheduler.plan(
      () if preempt is None else preempt(chunk, scheduler.slot_row_B.copy()))) is not None:
    if plan.stopped_B.any():
      engine.stats["preemptions"] += int(plan.stopped_B.sum())
      state = slots_lib.release(state, put(plan.stopped_B))
    if plan.keep_C is not None:  # the pool stays where it is: only the slots' state moves
      args = (state.replace(caches=()), put(plan.keep_C))
      state = engine.compiled(slots_lib.select, args, dict(mesh=mesh), takes_cfg=False)(
          *args).replace(caches=state.caches)
    if plan.source_Q is not None:  # the old pool's only references go to `repage`'s list
      caches, state = list(state.caches), state.replace(caches=())
      slots_lib.repage(engine.compiled, caches, put(plan.source_Q.astype(np.int32)), mesh)
      state = state.replace(caches=tuple(caches))
    if plan.free.size:
      admit_start = time.perf_counter()
      resumed = lengths_R[plan.new_rows] > 0
      state, carry = admitter(state, carry, plan.new_rows[~resumed], plan.free[~resumed])
      if resumed.any():
        state = admitter.resume(state, plan.new_rows[resumed], plan.free[resumed],
                                tokens_RxN, lengths_R)
      engine.stats["admit_s"] += time.perf_counter() - admit_start
    args = (params, layers, state, *put(table.device_args()), *scalars)
    state, out = engine.compiled(slots_lib.decode_chunk, args, options)(*args)
    out = sharding.to_host(out)
    chunk += 1
    host_start = time.perf_counter()
    taken, B = int(out["taken"]), table.slots
    engine.stats["decode_steps"] += taken
    engine.stats["slot_steps"] += B * taken
    engine.stats["attended_slots"] += table.pages * page_size * taken / B
    release_B = np.zeros(B, bool)
    for b in scheduler.live():
      r, end = scheduler.slot_row_B[b], out["steps_B"][b]
      start = lengths_R[r]
      tokens_RxN[r, start:end] = out["tokens_BxC"][b, :end - start]
      logp_RxN[r, start:end] = out["logprobs_BxC"][b, :end - start]
      if ent_RxN is not None:
        ent_RxN[r, start:end] = out["entropy_BxC"][b, :end - start]
      if out["done_B"][b] and scheduler.pending:  # a refill in the chunk had used these
        engine.stats["chunk_idle_steps"] += taken - int(end - start)
      release_B[b] = (not out["done_B"][b] and bool(sampling.stop_strings)
                      and _stopped(engine.tokenizer, tokens_RxN[r, :end], start,
                                   sampling.stop_strings))
      scheduler.advance(b, end, out["done_B"][b] or release_B[b])
    if release_B.any():
      state = slots_lib.release(state, put(release_B))
    engine.stats["host_s"] += time.perf_counter() - host_start
  last_R = tokens_RxN[np.arange(R), np.maximum(lengths_R - 1, 0)]
  return dict(tokens_BxN=tokens_RxN, logprobs_BxN=logp_RxN, entropy_BxN=ent_RxN,
              lengths_B=lengths_R, eos_B=(lengths_R > 0) & np.isin(last_R, engine.eos_ids))


def _stopped(tokenizer, ids, new_from: int, stop_strings) -> bool:
  """Whether `ids`' text contains a stop string, looked for around the new tokens."""
  window = ids[max(new_from - _STOP_LOOKBACK, 0):]
  return (outputs.has_stop_string(tokenizer, window, stop_strings)
          and outputs.has_stop_string(tokenizer, ids, stop_strings))


class _Admitter:
  """Loads waiting rows into free slots with `slots.admit`, keeping the carry's prompt."""

  def __init__(self, engine, prompt_ids, prompt_index_R, row_keys_R, weights_, prompt_len,
               table, put):
    self.engine, self.prompt_ids, self.prompt_index_R = engine, prompt_ids, prompt_index_R
    self.row_keys_R, self.weights, self.L, self.table, self.put = (row_keys_R, weights_,
                                                                  prompt_len, table, put)
    self.B = table.slots
    self.rows_per_call = min(MAX_ROWS, self.B)
    self.carry_prompt = -1

  def __call__(self, state, carry, rows, slot_of_row):
    """Admits rows `rows` (positions in the request) into slots `slot_of_row`."""
    first = 0
    while first < len(rows):
      new, sources = [], []
      for r in rows[first:first + self.rows_per_call]:
        p = self.prompt_index_R[r]
        if p != self.carry_prompt and p not in new:
          if len(new) == MAX_PROMPTS:
            break
          new.append(p)
        sources.append(0 if p == self.carry_prompt else 1 + new.index(p))
      state, carry = self._call(state, carry, rows[first:first + len(sources)], new, sources,
                                slot_of_row[first:first + len(sources)])
      self.carry_prompt = self.prompt_index_R[rows[first + len(sources) - 1]]
      first += len(sources)
    return state, carry

  def resume(self, state, rows, slot_of_row, tokens_RxN, lengths_R):
    """Places preempted rows `rows` back, into slots `slot_of_row`: each row's prompt and
    the tokens it had emitted run through the model again (`slots.resume`), and it
    goes on from its step count, with its own key."""
    A = resume_rows(self.B, self.table.shards)
    for first in range(0, len(rows), A):
      part, slots = rows[first:first + A], slot_of_row[first:first + A]
      seqs = [np.concatenate([np.asarray(self.prompt_ids[self.prompt_index_R[r]], np.int32),
                              tokens_RxN[r, :lengths_R[r]]]) for r in part]
      M = decode.length_bucket(max(map(len, seqs)), self.L)
      seq_AxM = np.full((A, M), self.engine.pad_id, np.int32)
      valid_AxM = np.zeros((A, M), bool)
      for a, seq in enumerate(seqs):
        seq_AxM[a, M - len(seq):], valid_AxM[a, M - len(seq):] = seq, True
      self.engine.stats["recomputed_tokens"] += int(lengths_R[part].sum())
      args = (*self.weights, *self.put((seq_AxM, valid_AxM)))
      rows_state = self.engine.compiled(slots_lib.resume, args, {})(*args)
      slot_A = np.full(A, self.B, np.int32)  # B: out of range, dropped
      slot_A[:len(slots)] = slots
      steps_A = np.zeros(A, np.int32)
      steps_A[:len(part)] = lengths_R[part]
      keys_A = jnp.take(self.row_keys_R, jnp.asarray(np.resize(part, A)), axis=0)
      args = (state, rows_state, *self.put((slot_A, self.table.prompt_pages(slot_A, M))),
              keys_A, self.put(steps_A))
      state = self.engine.compiled(slots_lib.place, args, {}, takes_cfg=False)(*args)
    return state

  def _call(self, state, carry, rows, new_prompts, sources, slot_of_row):
    A, L = self.rows_per_call, self.L
    self.engine.stats["prefills"] += len(new_prompts)
    P = decode.bucket(len(new_prompts)) if new_prompts else 0
    prompt_PxL = np.full((P, L), self.engine.pad_id, np.int32)
    valid_PxL = np.zeros((P, L), bool)
    for j, p in enumerate(new_prompts):
      ids = np.asarray(self.prompt_ids[p], np.int32)
      prompt_PxL[j, L - len(ids):], valid_PxL[j, L - len(ids):] = ids, True
    source_A = np.zeros(A, np.int32)
    source_A[:len(sources)] = sources
    slot_A = np.full(A, self.B, np.int32)  # B: out of range, dropped
    slot_A[:len(slot_of_row)] = slot_of_row
    keys_A = jnp.take(self.row_keys_R, jnp.asarray(np.resize(rows, A)), axis=0)
    args = (*self.weights, carry, *self.put((prompt_PxL, valid_PxL, source_A)),
            self.put(np.int32(sources[-1])))
    admitted, carry = self.engine.compiled(slots_lib.admit, args, {})(*args)
    args = (state, admitted, *self.put((slot_A, self.table.prompt_pages(slot_A))), keys_A,
            self.put(np.zeros(A, np.int32)))
    return self.engine.compiled(slots_lib.place, args, {}, takes_cfg=False)(*args), carry
