"""Every program a training step runs, as abstract calls for ahead-of-time compilation.

`training_step(config, model_cfg, mesh)` lists them with the shapes and shardings the
trainer gives them, at the config's worst case (every prompt at `data.max_prompt_tokens`,
every response at `rollout.max_new_tokens`, the whole batch fresh):

  learner_step    `learner.train_step`'s program: one optimizer step over a mini-batch
                  of micro-batches of packed rows (AdamW, parameters and state donated)
  score           `learner.score_responses`' program: one batch of rows through the
                  forward pass (the old-log-prob recompute and trajectory selection)
  rollout_copy    the sampler's resharded, compute-dtype copy of the parameters
  prepare_layers  the per-layer decode weights every rollout program reads
  generate        the static decode loop (`decode.generate`), where the engine uses it;
                  otherwise continuous batching's programs (`sampling.slots`):
  empty (the page pool at its first size), repage_layer (one layer of it grown to its
  largest, where it has several sizes: not the TPU kernel's), admit (prefill of the most
  prompts one call takes), place, resume and place_resumed (a preempted row's prefill at
  its longest, where `rollout.kv_pages` caps the pool below every slot's row at its
  longest), select, decode_chunk (over the largest pool), release

Evaluation runs the rollout's programs with the eval settings; those that differ from
the rollout's are listed again as `eval_*`. The calls are the real jitted functions:
what `exgrpo_jax.aot` compiles is what the trainer would run.
"""

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax import sharding
from exgrpo_jax.models import lora
from exgrpo_jax.sampling import continuous
from exgrpo_jax.sampling import decode
from exgrpo_jax.sampling import pages
from exgrpo_jax.sampling import paged_kernel
from exgrpo_jax.sampling import slots as slots_lib
from exgrpo_jax.training import learner
from exgrpo_jax.training import lora_run
from exgrpo_jax.training import padding
from exgrpo_jax.training import phase


@dataclasses.dataclass
class Program:
  """One jitted function called with abstract arguments.

  args: given the abstract outputs of the programs compiled before (by name), the
    positional arguments; kwargs are the static ones.
  calls: how often a training step calls it (for the step's estimate).
  steps: iterations of its decode loop per call (1: no loop).
  streamed: positional arguments the decode loop reads at every step (weights, cache).
  cache_share: the share of the last streamed argument (the cache) a step reads: all of
    it for XLA's attention over the pool; for the paged-attention kernel, which reads
    each row's live pages, their mean over a row's life (an estimate).
  in_place: it updates its donated arguments (the slots and their page pool) where it
    writes, so the roofline does not count them read and written whole per call.
  resident: given the same outputs, what else is on the devices during the call: the
    learner's state through a rollout, the rollout's weights and pool between its
    programs (the memory a call has is the device's less these).
  """

  name: str
  purpose: str
  fn: Any
  args: Callable[[dict], tuple]
  kwargs: dict = dataclasses.field(default_factory=dict)
  calls: float = 1.0
  steps: int = 1
  streamed: tuple = ()
  cache_share: float = 1.0
  in_place: bool = False
  resident: Callable[[dict], tuple] = lambda _: ()


def _struct(shape, dtype, mesh):
  """A replicated argument: what the engine's `jax.device_put(..., replicated)` gives."""
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.replicated(mesh))


def _key_dtype():
  return jax.random.key(0).dtype


def _lora_state(config, cfg, mesh):
  """A LoRA run's abstract state: (`lora.LoraParams` of the frozen base, quantized with
  `model.lora.base_quant` and placed as the trainer places it, and the adapters; the
  adapters' optimizer state)."""
  c = config.model.lora
  base = sharding.abstract(lora_run.abstract_base(config, cfg),
                           lora_run.base_shardings(config, cfg, mesh))
  shardings = lora.adapter_shardings(cfg, c.rank, tuple(c.targets), mesh)
  abstract = lora.abstract_adapters(cfg, c.rank, tuple(c.targets))
  tx = learner.make_optimizer(config.optim)
  opt_state = sharding.abstract(
      jax.eval_shape(tx.init, abstract),
      sharding.optimizer_shardings(tx, abstract, shardings))
  adapters = sharding.abstract(abstract, shardings)
  return lora.LoraParams(base, adapters, lora.scale(c)), opt_state


def learner_programs(config, cfg, mesh) -> tuple[list[Program], tuple]:
  """The learner's step and the scoring pass; also returns the abstract learner state
  (parameters, optimizer state). With LoRA (`model.lora.rank` > 0) the parameters are
  `lora.LoraParams` and the step takes the adapters and their state, the frozen base
  beside them (`learner.train_step`)."""
  if config.model.lora.rank:
    params, opt_state = _lora_state(config, cfg, mesh)
  else:
    params, opt_state = learner.abstract_state(cfg, learner.make_optimizer(config.optim),
                                               mesh)
  rows = config.train.batch_questions * config.rollout.k
  R = config.rollout.max_new_tokens
  T = padding.prompt_bucket(config.data.max_prompt_tokens, config.train.prompt_bucket) + R
  micro = config.optim.micro_batch_size
  per_mini = -(-rows // config.optim.mini_batches)  # as the actor splits a step
  num_micro = -(-per_mini // micro)
  shapes = dict(tokens_MxBxT=(T, jnp.int32), segment_ids_MxBxT=(T, jnp.int32),
                index_MxBxR=(R, jnp.int32), mask_MxBxR=(R, bool),
                old_logp_MxBxR=(R, jnp.float32), adv_MxBxR=(R, jnp.float32),
                is_replay_MxBxR=(R, bool), weight_MxBxR=(R, jnp.float32))
  recompute = phase.recompute_old_logps(config)
  if recompute:  # as `Actor.update` builds the batch
    shapes["rollout_log_ratio_MxBxR"] = (R, jnp.float32)
  batch = sharding.placed(learner.TrainBatch(**{
      name: jax.ShapeDtypeStruct((num_micro, micro, n), dtype)
      for name, (n, dtype) in shapes.items()}), mesh, batch_dim=1)
  # LoRA's step trains the adapters; the base is an argument, neither trained nor donated.
  is_lora = isinstance(params, lora.LoraParams)
  trained = params.adapters if is_lora else params
  frozen = (params.replace(adapters=None),) if is_lora else ()
  # The mixed phase's step (no clipping unless configured): most of a run's steps.
  step = Program(
      "learner_step", f"one optimizer step: {num_micro} micro-batches of {micro} rows x "
      f"{T} tokens", learner.step_program(trained, opt_state),
      lambda _: (trained, opt_state, batch) + frozen,
      dict(cfg=cfg, algo=learner.frozen(config.algo), optim=learner.frozen(config.optim),
           use_clip=bool(config.algo.clip_after_delayed_start),
           chunk=config.train.logprob_chunk),
      calls=config.optim.mini_batches)
  score_rows = sharding.placed((jax.ShapeDtypeStruct((micro, T), jnp.int32),
                                jax.ShapeDtypeStruct((micro, T), jnp.int32),
                                jax.ShapeDtypeStruct((micro, R), jnp.int32)), mesh)
  # Old log-probs are recomputed for every fresh response (one row each at worst).
  temperature = phase.rollout_logp_temperature(config.rollout)
  score = Program(
      "score", f"log-probs and entropies of {micro} rows x {T} tokens (old-log-prob "
      "recompute, trajectory selection)", learner.score_program(mesh),
      lambda _: (cfg, params, *score_rows, config.train.logprob_chunk, temperature),
      calls=math.ceil(rows / micro) if recompute else 0,
      resident=lambda _: (opt_state,))
  return [step, score], (params, opt_state)


def rollout_key(engine, sampling_cfg, rows: int, prompt_len: int) -> tuple:
  """What decides the shapes and options of `rollout_programs`' programs."""
  N = sampling_cfg.max_new_tokens
  slots = engine.continuous_slots(rows, N)
  return (slots or decode.bucket(min(rows, engine.max_rows or rows)), N,
          decode.length_bucket(prompt_len, engine.min_prompt_bucket),
          sampling_cfg.is_greedy, sampling_cfg.top_k, sampling_cfg.top_p < 1.0,
          sampling_cfg.return_entropy)


def rollout_programs(engine, cfg, mesh, learner_state, sampling_cfg, rows: int,
                     prompts: int, prompt_len: int, prefix: str = "") -> list[Program]:
  """The programs `engine.generate` runs for `rows` rows of `prompts` prompts, while
  `learner_state` (parameters, optimizer state) stays on the devices."""
  N = sampling_cfg.max_new_tokens
  L = decode.length_bucket(prompt_len, engine.min_prompt_bucket)
  pcfg = engine.program_cfg
  E = len(engine.eos_ids)
  scalars = tuple(_struct((), dtype, mesh) for dtype in (jnp.float32, jnp.float32, bool)) + (
      _struct((E,), jnp.int32, mesh),)
  options = sampling_cfg.program_options()
  copy = Program("rollout_copy", "the sampler's copy of the parameters",
                 engine.rollout_copy_program(mesh), lambda _: (learner_state[0],),
                 resident=lambda _: learner_state[1:])
  params = lambda out: out["rollout_copy"]  # evaluation shares the rollout's copy
  # Continuous batching's weights (`continuous.weights`): the copy's stacked layers are
  # freed once prepared, so its programs read these.
  rest = lambda out: continuous.without_layers(params(out))
  layers = lambda out: out[prefix + "prepare_layers"]
  # What stays on the devices beside a rollout program's own arguments.
  weights = lambda out: (*learner_state, rest(out), layers(out))
  prepare = Program(prefix + "prepare_layers", "per-layer decode weights",
                    slots_lib.prepare_layers, lambda out: (pcfg, params(out)),
                    resident=lambda _: learner_state)
  slots = engine.continuous_slots(rows, N, mesh)
  if not slots:
    per_call = min(rows, engine.max_rows or rows)
    B, P = decode.bucket(per_call), decode.bucket(max(per_call * prompts // rows, 1))
    batch = sharding.placed((jax.ShapeDtypeStruct((P, L), jnp.int32),
                             jax.ShapeDtypeStruct((P, L), bool),
                             jax.ShapeDtypeStruct((B,), jnp.int32),
                             jax.ShapeDtypeStruct((B,), bool),
                             jax.ShapeDtypeStruct((B,), _key_dtype())), mesh)
    phases = engine.phases(sampling_cfg)
    return [copy, prepare, Program(
        prefix + "generate", f"prefill and decode {B} rows (static loop)", decode.generate,
        lambda out: (pcfg, rest(out), layers(out), *batch, *scalars),
        dict(options, phases=phases), calls=-(-rows // per_call), steps=N, streamed=(1, 2),
        resident=lambda _: learner_state)]
  kernel = paged_kernel.wanted(pcfg, mesh, slots)
  table = pages.PageTable(slots, engine.page_size, L, N, sharding.batch_shards(mesh),
                          engine.kv_pages, kernel=kernel)
  pool, per_row = table.sizes[-1], table.table_BxN.shape[1]
  A = min(continuous.MAX_ROWS, slots)
  P = decode.bucket(continuous.MAX_PROMPTS)
  steps = engine.chunk_steps
  i32 = lambda *shape: _struct(shape, jnp.int32, mesh)
  # Every row at its longest (the worst case): at a uniform step of its life, a row holds
  # its prompt and half its response of the per_row pages it may grow to.
  live = (L + N / 2) / (per_row * engine.page_size) if kernel else 1.0
  # A pool of several sizes starts at its smallest and grows layer by layer
  # (`slots.repage`); the later programs take it at its largest, the memory's worst case.
  if len(table.sizes) == 1:
    grown = lambda out: out[prefix + "empty"][0]
    repage = []
  else:
    grown = lambda out: out[prefix + "empty"][0].replace(
        caches=(out[prefix + "repage_layer"],) * cfg.num_layers)
    grows_from = table.sizes[-2]  # the costliest growth
    repage = [Program(
        prefix + "repage_layer", f"one layer of the pool grown from {grows_from} to its "
        f"largest, {pool} pages", slots_lib.repage_layer,
        lambda out: (tuple(jax.ShapeDtypeStruct((grows_from,) + x.shape[1:], x.dtype,
                                                sharding=x.sharding)
                           for x in out[prefix + "empty"][0].caches[0]), i32(pool)),
        dict(mesh=mesh), calls=0,
        # the other layers, each old or already moved: at most the larger size
        resident=lambda out: (*weights(out), grown(out).caches[1:]))]
  # Rows at their longest: as many at once as the pool holds.
  at_once = min(slots, table.capacity_per_shard // per_row * table.shards)
  resumes = []
  if at_once < slots:  # a pool that runs out preempts rows and resumes them
    M = decode.length_bucket(L + N - 1, L)  # the longest: a prompt and N - 1 tokens
    R = continuous.resume_rows(slots, table.shards)
    resumes = [
        Program(prefix + "resume", f"prefill of {R} preempted rows x {M} tokens",
                slots_lib.resume,
                lambda out: (pcfg, rest(out), layers(out), i32(R, M),
                             _struct((R, M), bool, mesh)),
                calls=0, resident=lambda out: (*learner_state, grown(out))),
        Program(prefix + "place_resumed", f"{R} resumed rows into slots and pages",
                slots_lib.place,
                lambda out: (grown(out), out[prefix + "resume"], i32(R),
                             i32(R, -(-M // engine.page_size)),
                             _struct((R,), _key_dtype(), mesh), i32(R)),
                calls=0, in_place=True, resident=weights)]
  return [
      copy,
      prepare,
      Program(prefix + "empty", f"{slots} slots and the page pool at its first size "
              f"({table.pages} pages of {engine.page_size})", slots_lib.empty,
              lambda out: (pcfg, rest(out), _struct((), _key_dtype(), mesh)),
              dict(slots=slots, pages=table.pages, page_size=engine.page_size, prompt_len=L,
                   kernel=kernel, mesh=mesh),
              resident=lambda out: (*learner_state, layers(out))),
      *repage,
      Program(prefix + "admit", f"prefill of {P} prompts x {L} tokens into {A} rows",
              slots_lib.admit,
              lambda out: (pcfg, rest(out), layers(out), out[prefix + "empty"][1],
                           _struct((P, L), jnp.int32, mesh), _struct((P, L), bool, mesh),
                           i32(A), i32()),
              calls=-(-prompts // continuous.MAX_PROMPTS),
              resident=lambda out: (*learner_state, grown(out))),
      Program(prefix + "place", f"{A} admitted rows into slots and pages", slots_lib.place,
              lambda out: (grown(out), out[prefix + "admit"][0], i32(A),
                           i32(A, -(-L // engine.page_size)),
                           _struct((A,), _key_dtype(), mesh), i32(A)),
              calls=-(-rows // A), in_place=True, resident=weights),
      *resumes,
      Program(prefix + "select", f"the live half of {slots} slots", slots_lib.select,
              lambda out: (grown(out).replace(caches=()), i32(slots // 2)), dict(mesh=mesh),
              calls=0, resident=lambda out: (*weights(out), grown(out).caches)),
      Program(prefix + "decode_chunk", f"{steps} decode steps of {slots} slots over the "
              f"{pool}-page pool", slots_lib.decode_chunk,
              lambda out: (pcfg, rest(out), layers(out), grown(out),
                           i32(slots, per_row), i32(pool), i32(pool), *scalars),
              options | dict(steps=steps), calls=rows * N / at_once / steps, steps=steps,
              streamed=(2, 3), cache_share=live, in_place=True,
              resident=lambda _: learner_state),
      Program(prefix + "release", "slots freed by stop strings", slots_lib.release,
              lambda out: (grown(out), _struct((slots,), bool, mesh)), calls=0,
              in_place=True, resident=weights),
  ]


def training_step(config, cfg, mesh) -> list[Program]:
  """Every program of one training step of `config` for model `cfg` on `mesh`."""
  programs, learner_state = learner_programs(config, cfg, mesh)
  engine = sampling.make_engine("jax", cfg, None, max_rows=config.rollout.max_rows or None,
                                scheduler=config.rollout.scheduler,
                                kv_pages=config.rollout.kv_pages or None,
                                kv_headroom=config.rollout.kv_headroom)
  rows = config.train.batch_questions * config.rollout.k
  train_sampling = sampling.SamplingConfig.for_rollout(config.rollout)
  rollout = rollout_programs(engine, cfg, mesh, learner_state, train_sampling, rows,
                             config.train.batch_questions, config.data.max_prompt_tokens)
  programs += rollout
  if config.eval.every or config.eval.before_train:
    eval_sampling = sampling.SamplingConfig(
        temperature=config.eval.temperature, greedy=config.eval.temperature == 0,
        max_new_tokens=config.eval.max_new_tokens)
    # The evaluation set's size is the data's; at worst it fills the rollout's slots.
    eval_rows = max(config.eval.n * (config.eval.limit or rows), 1)
    prompt_len = config.data.max_prompt_tokens
    if (rollout_key(engine, eval_sampling, eval_rows, prompt_len)
        != rollout_key(engine, train_sampling, rows, prompt_len)):
      evaluation = rollout_programs(engine, cfg, mesh, learner_state, eval_sampling, eval_rows,
                                    max(eval_rows // config.eval.n, 1), prompt_len,
                                    prefix="eval_")
      programs += [dataclasses.replace(p, calls=0) for p in evaluation[1:]]
  return programs
