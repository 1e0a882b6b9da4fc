"""The default rollout engine: the JAX KV-cache sampler (CPU, GPU, TPU).

Shapes are bucketed so a training run compiles a handful of programs: the number of
distinct prompts and of rows round up to a power of two up to 64 and to a multiple of 64
beyond; the longest prompt rounds up to a multiple of 1/8 of the next power of two (at
least `min_prompt_bucket`): 4 lengths per doubling, less than 1/4 of the prefill spent
on bucket padding. `max_new_tokens` and the static sampling switches (top-k, top-p
on/off, entropy) complete the key. Temperature, top-p and greedy are traced, so
training (T = 1) and evaluation (T = 0.6 or greedy) share a program. Compiled programs are kept per key (shared by all engines of this
process; token ids such as EOS are arguments, not part of the key), and `stats` reports
compile and generation time separately.

Scheduling: with `scheduler="continuous"` (the default) and more rows than `max_rows`,
the rows go through `max_rows` decode slots, each refilled with the next waiting row as
soon as its row ends (`continuous`). Rollouts of `continuous_from` new tokens or more go
through it even when every row has a slot: it also shrinks the tail to the live rows and
lets each row attend to its own pages only. Otherwise (`scheduler="static"`, or short
rollouts whose rows all have a slot) the rows are split into calls of at most `max_rows`
rows, each decoded until its last row ends (`decode.generate`, whose KV cache grows in
phases on long rollouts). Both give the same rows.

Randomness: row r (prompt-major, counting from 0 over the whole call) draws its step-t
token with fold_in(fold_in(key, r), t), so the same key gives the same output, whatever
the batch it was bucketed into or split across (`max_rows`).

Sharding: when the params live on a mesh (`exgrpo_jax.sharding`), each call makes a
rollout copy of them in device memory, resharded to the sampler's rules (by default
`sharding.SAMPLER_RULES`: no FSDP, tensor parallelism kept) and cast to the compute dtype
(the model casts every weight to it before use anyway, so the results are the same and
the copy is half the size of float32 master weights); it splits prompts and rows over
the mesh's batch axes and gathers the results to every process.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from exgrpo_jax import models
from exgrpo_jax import sharding
from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import lora
from exgrpo_jax.sampling import base
from exgrpo_jax.sampling import continuous
from exgrpo_jax.sampling import decode
from exgrpo_jax.sampling import outputs

SCHEDULERS = ("continuous", "static")
# Rollouts this long go through continuous scheduling even when every row has a slot
# (docs/sampler_performance.md measures where it starts to pay).
CONTINUOUS_FROM = 512

# (program, model config, argument shapes, static options) -> (compiled program, its
# memory analysis: read once, as it costs ~40 ms on CPU, a decode chunk's tenth).
_COMPILED = {}


@base.ENGINES.register("jax")
class JaxEngine:
  """Generates with `exgrpo_jax.sampling.decode.generate` on the default JAX devices.

  Args:
    model_cfg: the policy's ModelConfig.
    tokenizer: HF tokenizer (texts, stop strings, EOS/pad ids); None for id-only use.
    min_prompt_bucket: the finest prompt-length bucket (see the module docstring).
    max_rows: the most rows decoded at once (the KV cache's size). With more rows than
      that, "continuous" decodes them in max_rows slots and "static" splits them by
      prompt into calls (a prompt's samples stay in one call). None: all rows at once.
    ignore_eos: never stop on EOS (benchmarks: every row decodes max_new_tokens).
    rules: logical-axis rules of the rollout copy of sharded params.
    cache_phases: how many phases the static loop's KV cache grows in during decoding
      (`decode.generate`); None: `decode.phases_for(max_new_tokens)`.
    scheduler: "continuous" or "static" (see the module docstring).
    chunk_steps: continuous scheduling's decode steps per device call (rows that end
      inside a chunk leave their slot idle until its end).
    page_size: continuous scheduling's KV-cache page, in slots (`continuous`).
    kv_pages: the most pages the continuous KV pool holds (`rollout.kv_pages`); None:
      every slot's row at its longest. Below that, rows are admitted while their shard
      has pages for their next chunk and preempted when it runs out (`continuous`); with
      it, rows always decode continuously.
    kv_headroom: the share of the pool's pages kept free when admitting a row beside
      running ones (`rollout.kv_headroom`): fewer preemptions.
    continuous_from: the fewest max_new_tokens at which "continuous" schedules rows that
      all have a slot too (see the module docstring); None: only rows that wait.
  """

  def __init__(self, model_cfg, tokenizer=None, min_prompt_bucket: int = 16,
               max_rows: int | None = None, ignore_eos: bool = False,
               rules=sharding.SAMPLER_RULES, cache_phases: int | None = None,
               scheduler: str = "continuous", chunk_steps: int = 16, page_size: int = 64,
               continuous_from: int | None = CONTINUOUS_FROM, kv_pages: int | None = None,
               kv_headroom: float = 0.0):
    if cache_phases is not None and cache_phases < 1:
      raise ValueError(f"cache_phases must be None or >= 1, got {cache_phases}")
    if scheduler not in SCHEDULERS:
      raise ValueError(f"rollout scheduler must be one of {', '.join(SCHEDULERS)}, "
                       f"got {scheduler!r}")
    if chunk_steps < 1:
      raise ValueError(f"chunk_steps must be >= 1, got {chunk_steps}")
    if page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    if continuous_from is not None and continuous_from < 0:
      raise ValueError(f"continuous_from must be None or >= 0, got {continuous_from}")
    if max_rows is not None and max_rows < 1:
      raise ValueError(f"max_rows must be None or >= 1, got {max_rows}")
    if kv_pages is not None and (kv_pages < 1 or scheduler != "continuous"):
      raise ValueError(f"kv_pages={kv_pages} needs the continuous scheduler and >= 1 page")
    if not 0 <= kv_headroom < 1:
      raise ValueError(f"kv_headroom must be in [0, 1), got {kv_headroom}")
    self.kv_pages, self.kv_headroom = kv_pages, kv_headroom
    self.scheduler, self.chunk_steps, self.page_size = scheduler, chunk_steps, page_size
    self.continuous_from = continuous_from
    self.cache_phases = cache_phases
    self.model_cfg = model_cfg
    self.rules = rules
    self._reshard = {}  # mesh -> jitted reshard-and-cast to the rollout copy
    self.tokenizer = tokenizer
    self.min_prompt_bucket = min_prompt_bucket
    self.max_rows = max_rows
    self.eos_ids = (-1,) if ignore_eos else base.eos_ids(model_cfg, tokenizer)
    self.pad_id = base.pad_id(model_cfg, tokenizer)
    # Token ids do not change the program; leaving them out of the key lets engines with
    # other EOS ids share it.
    self.program_cfg = dataclasses.replace(model_cfg, eos_token_id=(), bos_token_id=None,
                                            pad_token_id=None)
    # decode_steps: steps of the decode loops; slot_steps: each step times the rows decoded
    # alongside (padding rows and ended rows included); new_tokens / slot_steps is the
    # fraction of decode work that was used.
    # attended_slots: decode steps times the cache slots a step reads per row (the static
    # loop: its cache's length; continuous: the page pool's slots over the slots).
    # prefills: prompts run through the model (padding excluded). Continuous scheduling
    # only: chunk_idle_steps, slot-steps of slots whose row ended inside a chunk while rows
    # were waiting; host_s, admit_s: host time between chunks, and admissions (dispatch
    # only: admissions run on the device while the host goes on); preemptions, rows
    # stopped for want of pages, and recomputed_tokens, the tokens they had emitted,
    # prefilled again when they resumed.
    self.stats = dict(compiles=0, compile_s=0.0, generate_s=0.0, calls=0, new_tokens=0,
                      decode_steps=0, slot_steps=0, attended_slots=0, prefills=0,
                      chunk_idle_steps=0, host_s=0.0, admit_s=0.0, preemptions=0,
                      recomputed_tokens=0, memory={})

  def update_weights(self, params) -> None:
    """Nothing to do: the current params are an argument of every call."""
    del params

  def close(self) -> None:
    """Nothing to release: the compiled programs stay cached for the process."""

  def generate(self, prompt_ids, n, params, key, sampling: base.SamplingConfig):
    """See `base.RolloutEngine`; `n` is an int or one count per prompt."""
    counts = base.sample_counts(prompt_ids, n)
    prompt_index_N = np.repeat(np.arange(len(counts)), counts).astype(np.int32)
    if prompt_index_N.size == 0:
      return outputs.empty(sampling.max_new_tokens, sampling.return_entropy)
    longest = max(len(prompt_ids[i]) for i in set(prompt_index_N.tolist()))
    if longest + sampling.max_new_tokens > self.model_cfg.max_position_embeddings:
      raise ValueError(
          f"prompt of {longest} tokens + max_new_tokens={sampling.max_new_tokens} exceeds "
          f"the model's max_position_embeddings={self.model_cfg.max_position_embeddings}")
    start = time.perf_counter()
    slots = self.continuous_slots(prompt_index_N.size, sampling.max_new_tokens,
                                  sharding.mesh_of(params))
    # No name holds the rollout copy: its stacked layers go once they are prepared.
    weights = continuous.weights(self, self._rollout_params(params))
    if slots:
      parts = [continuous.generate(
          self, prompt_ids, prompt_index_N, np.arange(prompt_index_N.size), weights, key,
          sampling, self._prompt_bucket(prompt_ids, prompt_index_N), slots, self.page_size,
          self.kv_pages, self.kv_headroom)]
    else:
      parts = [self._generate_rows(prompt_ids, prompt_index_N[rows], rows, weights, key,
                                   sampling) for rows in self._split(counts)]
    raw = {k: (None if parts[0][k] is None else np.concatenate([p[k] for p in parts]))
           for k in parts[0]}
    self.stats["generate_s"] += time.perf_counter() - start
    self.stats["calls"] += 1
    self.stats["new_tokens"] += int(raw["lengths_B"].sum())
    return outputs.finalize(raw["tokens_BxN"], raw["logprobs_BxN"], raw["entropy_BxN"],
                            raw["lengths_B"], raw["eos_B"], prompt_index_N, self.tokenizer,
                            sampling.stop_strings, self.pad_id)

  def _rollout_params(self, params):
    """The rollout copy of sharded params (see the module docstring); others as they are.
    LoRA params are merged (`lora.merge`): every call samples the current adapter."""
    mesh = sharding.mesh_of(params)
    return lora.merged(params) if mesh is None else self.rollout_copy_program(mesh)(params)

  def rollout_copy_program(self, mesh):
    """The jitted reshard-and-cast of the learner's params (LoRA: merged, in the same
    program) to the rollout copy on `mesh`."""
    if mesh not in self._reshard:
      dtype = config_lib.dtype_from_name(self.model_cfg.dtype)
      self._reshard[mesh] = jax.jit(
          lambda p: jax.tree.map(lambda x: x.astype(dtype), lora.merge(p)),
          out_shardings=models.param_shardings(self.model_cfg, mesh, self.rules))
    return self._reshard[mesh]

  def continuous_slots(self, rows: int, max_new_tokens: int, mesh=None) -> int:
    """The slots continuous scheduling decodes `rows` rows in; 0: the static loop. On a
    mesh, a multiple of its batch shards: each device holds as many slots, and their
    rows' pages (`pages.PageTable`)."""
    if self.scheduler != "continuous":
      return 0
    if self.max_rows is not None and rows > self.max_rows:
      slots = self.max_rows
    elif self.kv_pages is None and (self.continuous_from is None
                                    or max_new_tokens < self.continuous_from):
      return 0
    else:
      slots = decode.bucket(rows)  # the static loop's batch for these rows
      slots = slots if self.max_rows is None else min(slots, self.max_rows)
    shards = sharding.batch_shards(mesh)
    return -(-slots // shards) * shards

  def _split(self, counts: np.ndarray) -> list[np.ndarray]:
    """Row-index ranges for each call: whole prompts, at most `max_rows` rows each."""
    ends = np.cumsum(counts)
    if self.max_rows is None or ends[-1] <= self.max_rows:
      return [np.arange(ends[-1])]
    chunks, first = [], 0
    for end, count in zip(ends, counts):
      if count > self.max_rows:
        raise ValueError(f"a prompt asks for {count} samples but max_rows={self.max_rows}")
      if end - first > self.max_rows:
        chunks.append(np.arange(first, end - count))
        first = end - count
    chunks.append(np.arange(first, ends[-1]))
    return [c for c in chunks if c.size]

  def _generate_rows(self, prompt_ids, prompt_index_R, rows_R, weights, key, sampling):
    """Runs one bucketed call for rows `rows_R` (global row ids) of prompts `prompt_index_R`,
    with the model's `weights` (`continuous.weights`)."""
    prompts, row_prompt_R = np.unique(prompt_index_R, return_inverse=True)
    R, P = len(rows_R), len(prompts)
    B, Pb = decode.bucket(R), decode.bucket(P)
    L = self._prompt_bucket(prompt_ids, prompts)
    prompt_PxL = np.full((Pb, L), self.pad_id, np.int32)
    valid_PxL = np.zeros((Pb, L), bool)
    for j, p in enumerate(prompts):
      ids = np.asarray(prompt_ids[p], np.int32)
      prompt_PxL[j, L - len(ids):] = ids
      valid_PxL[j, L - len(ids):] = True
    row_prompt_B = np.zeros(B, np.int32)
    row_prompt_B[:R] = row_prompt_R
    live_B = np.arange(B) < R
    row_ids_B = np.concatenate([rows_R, np.arange(B - R) + rows_R[-1] + 1]).astype(np.uint32)
    keys_B = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.asarray(row_ids_B))
    rows = (prompt_PxL, valid_PxL, row_prompt_B, live_B, keys_B)
    scalars = (np.float32(sampling.temperature), np.float32(sampling.top_p),
               np.bool_(sampling.is_greedy), np.asarray(self.eos_ids, np.int32))
    mesh = sharding.mesh_of(weights)
    if mesh is not None:
      rows = sharding.put_batch(rows, mesh)
      scalars = jax.device_put(scalars, sharding.replicated(mesh))
    args = (*weights, *rows, *scalars)
    static = dict(sampling.program_options(), phases=self.phases(sampling))
    result = sharding.to_host(self.compiled(decode.generate, args, static)(*args))
    steps, N = int(result["lengths_B"].max()), sampling.max_new_tokens
    self.stats["decode_steps"] += steps
    self.stats["slot_steps"] += B * steps
    ends = decode.phase_ends(N, static["phases"])
    self.stats["attended_slots"] += sum(
        (L + end) * min(max(steps - start, 0), end - start)
        for start, end in zip([0] + ends[:-1], ends))
    self.stats["prefills"] += P
    return {k: (None if v is None else v[:R]) for k, v in result.items()}

  def phases(self, sampling) -> int:
    """Phases of the static loop's cache."""
    return self.cache_phases or decode.phases_for(sampling.max_new_tokens)

  def _prompt_bucket(self, prompt_ids, prompts) -> int:
    """The bucketed length L of these prompts' left-padded batch."""
    return decode.length_bucket(max(len(prompt_ids[p]) for p in prompts),
                                self.min_prompt_bucket)

  def compiled(self, program, args, static, takes_cfg: bool = True):
    """`program` (jitted; the model config its first argument if `takes_cfg`) compiled
    for these argument shapes and static options, once per process."""
    # The matmul precision too: jit's own cache keys on it, this one must as well.
    signature = (program, self.program_cfg, jax.config.jax_default_matmul_precision,
                 tuple((a.shape, a.dtype, getattr(a, "sharding", None))
                       for a in jax.tree.leaves(args)),
                 tuple(sorted(static.items())))
    if signature not in _COMPILED:
      start = time.perf_counter()
      cfg = (self.program_cfg,) if takes_cfg else ()
      with sharding.use_mesh(sharding.mesh_of(args)):
        program = program.lower(*cfg, *args, **static).compile()
      memory = program.memory_analysis()
      _COMPILED[signature] = program, (None if memory is None else {
          k: getattr(memory, k + "_size_in_bytes")
          for k in ("argument", "output", "temp", "generated_code")})
      self.stats["compiles"] += 1
      self.stats["compile_s"] += time.perf_counter() - start
    program, memory = _COMPILED[signature]
    if memory is not None:
      self.stats["memory"] = dict(memory)
    return program
