r"""LoRA's cost beside full fine-tuning: the learner step and the sampler's merge (JSON).

Shown in docs/lora.md ("Cost"); run from the repository root:

  python scripts/bench/bench_lora.py --out=docs/results/bench_lora.json

One process, the config's model at its training shapes (`--config`, default
configs/smollm2_study_v3.py: SmolLM2-135M-Instruct from the config's model source, 4
questions x K = 8 rollouts of 48 new tokens, mini-batches of 2 micro-batches of 8 rows),
full fine-tuning and LoRA at each of `--ranks` (default 1 and 8; alpha, targets and
base_quant as the config has them), side by side. Each run's state is the trainer's
(`RunState`: the base loaded as a run loads it, new adapters, a fresh AdamW).

* learner: `learner.train_step`, the jitted optimizer step the trainer runs, on one
  mini-batch of the config's shape at its worst case (every prompt at
  data.max_prompt_tokens, every response at rollout.max_new_tokens, the batch the
  trainer packs with `packing.train_batch`). Bytes: the trainable parameters and their
  optimizer state (tree sizes), and XLA's `memory_analysis()` of the compiled step
  program (`exgrpo_jax.aot.programs`' learner step at the config's shapes: arguments,
  outputs, temporaries, outputs aliased to donated arguments).
* sampler: the JAX engine's rollout-copy program, which reshards and casts the learner's
  parameters at each generate call and, with LoRA, merges W + (alpha / r) A B into the
  copy in the same program; the decode step of a rollout at the config's rows and
  length with that copy (`bench_sampler.bench_ours`: the time difference of two
  response lengths, EOS ignored), the same compiled program for every run since the
  merged copy has the base's shapes and dtypes; and the merge per decode step, the
  rollout copy's seconds over the decode steps of one generate call
  (rollout.max_new_tokens). Beside it, what an unmerged decode would add to every
  step at the least: the adapter products (x A) B of every layer and target for the
  step's rows, one jitted program in the sampler's dtype. A call of N decode steps costs
  the merged path one merge and the unmerged path N times the adapter products: the
  merge wins past the break-even N, merge_s over the products' seconds.

Seconds are medians of `--repeats` calls after one warm-up call (compile excluded), the
runs' calls interleaved so machine load hits them alike. Other work on the machine skews
them: run it on a quiet machine.
"""

import datetime
import json
import os
import platform
import sys
import tempfile
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run as a script
  sys.path.insert(0, REPO)

from exgrpo_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import config_cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import sampling  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import sharding  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.aot import programs  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.models import config as config_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.models import lora  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.training import config_check  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.training import learner  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.training import packing  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.training import padding  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.training import phase  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.training import run_state  # pylint: disable=g-import-not-at-top,wrong-import-position
from scripts.bench import bench_attention  # pylint: disable=g-import-not-at-top,wrong-import-position
from scripts.bench import bench_sampler  # pylint: disable=g-import-not-at-top,wrong-import-position

DEFAULT_CONFIG = "configs/smollm2_study_v3.py"
COMMAND = list(sys.argv)  # as typed, before the default config is filled in
# absl would parse a default config file, and its --config.KEY overrides, while defining
# the flag, where a bad key is a traceback; given as a flag, `flags_parser` says it in one
# line.
if not any(a.startswith("--config=") for a in sys.argv[1:]):
  sys.argv.insert(1, f"--config={os.path.join(REPO, DEFAULT_CONFIG)}")
config_cli.make_config_files_importable(sys.argv)
_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file "
                                          f"(default: {DEFAULT_CONFIG}).", lock_config=True)
_RANKS = flags.DEFINE_list("ranks", ["1", "8"], "LoRA ranks measured beside full "
                           "fine-tuning.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per program (after a warm-up).")
_OUT = flags.DEFINE_string("out", None, "Also write the JSON to this file.")

MERGED_PATH = (
    "The JAX engine samples a LoRA run with merged weights: W + (alpha / r) A B goes into "
    "its rollout copy once per generate call, in the program that reshards and casts that "
    "copy, and every decode step reads plain weights, so the adapter costs one merge per "
    "generate call and nothing per decode step. An unmerged decode would add the adapter "
    "products (x A) B to every decode step instead (unmerged_adapter_per_decode_step_s, "
    "their lower bound); the merged path costs less where merge_per_decode_step_s is the "
    "smaller.")


_START = time.perf_counter()


def _log(message: str) -> None:
  print(f"[bench_lora] {time.perf_counter() - _START:.0f} s: {message}", file=sys.stderr,
        flush=True)


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _ranks() -> list[int]:
  """--ranks as integers; UsageError (exit 2) for anything but whole numbers >= 1."""
  ranks = []
  for text in _RANKS.value:
    try:
      rank = int(text)
    except ValueError:
      rank = 0
    if rank < 1:
      raise cli.UsageError(f"--ranks: {text!r} is not a whole number >= 1")
    ranks.append(rank)
  if not ranks or len(set(ranks)) != len(ranks):
    raise cli.UsageError(f"--ranks={','.join(_RANKS.value)}: name each rank once")
  return ranks


def _configs(ranks: list[int]) -> dict:
  """{run name: its config}: full fine-tuning (the `model.lora` section at its defaults)
  and LoRA at each rank (the config's alpha, targets and base_quant); each checked as
  the trainer checks it."""
  runs = {}
  for rank in [0] + ranks:
    config = _CONFIG.value.copy_and_resolve_references()
    with config.unlocked():
      if rank:
        config.model.lora.rank = rank
      else:
        config.model.lora.update(lora.DEFAULTS)
      config.eval.every = 0
    config_check.check(config)
    runs[f"lora_r{rank}" if rank else "full"] = config
  return runs


def _worst_case_batch(config, model_cfg, pad_id: int) -> learner.TrainBatch:
  """One mini-batch as `Actor.update` packs it, every prompt at data.max_prompt_tokens
  and every response at rollout.max_new_tokens (random tokens, advantages +-1)."""
  rng = np.random.default_rng(0)
  rows = config.train.batch_questions * config.rollout.k
  per_mini = -(-rows // config.optim.mini_batches)
  P, N, V = config.data.max_prompt_tokens, config.rollout.max_new_tokens, model_cfg.vocab_size
  recompute = phase.recompute_old_logps(config)
  responses = [packing.Sequence(
      rng.integers(0, V, P, dtype=np.int32), rng.integers(0, V, N, dtype=np.int32),
      np.full(N, -np.log(V), np.float32), float(rng.choice([-1.0, 1.0])), False,
      np.zeros(N, np.float32) if recompute else None) for _ in range(per_mini)]
  return packing.train_batch(
      responses, prompt_len=padding.prompt_bucket(P, config.train.prompt_bucket),
      response_len=N, micro_batch=config.optim.micro_batch_size,
      num_micro=-(-per_mini // config.optim.micro_batch_size), pad_id=pad_id,
      aggregation=config.algo.aggregation, norm_len=config.algo.norm_len,
      pack=config.train.packing, rollout_log_ratio=recompute)


class _Run:
  """One run's state, learner step and rollout copy."""

  def __init__(self, config, workdir: str):
    self.config = config
    self.state = st = run_state.RunState.create_or_restore(config, workdir)
    self.params, self.opt_state = st.params, st.opt_state
    self.batch = _worst_case_batch(config, st.model_cfg, st.pad_id)
    self.step_options = dict(cfg=st.model_cfg, algo=learner.frozen(config.algo),
                             optim=learner.frozen(config.optim),
                             use_clip=phase.use_clip(st.replay_started,
                                                     config.algo.clip_after_delayed_start),
                             chunk=config.train.logprob_chunk)

  def memory(self) -> dict:
    """Bytes of the trainable tree and its optimizer state, and XLA's memory analysis of
    the step program compiled at the config's shapes (as the planner compiles it)."""
    step = programs.learner_programs(self.config, self.state.model_cfg, self.state.mesh)[0][0]
    planned = jax.tree.map(lambda x: x.shape, step.args({})[2])
    if planned != jax.tree.map(np.shape, self.batch):
      raise RuntimeError(f"the packed batch {jax.tree.map(np.shape, self.batch)} is not the "
                         f"planned step's {planned}")
    with sharding.use_mesh(self.state.mesh):
      m = step.fn.lower(*step.args({}), **step.kwargs).compile().memory_analysis()
    trainable = self.params.adapters if self.is_lora else self.params
    out = dict(trainable_params=sum(x.size for x in jax.tree.leaves(trainable)),
               trainable_bytes=_nbytes(trainable),
               optimizer_state_bytes=_nbytes(self.opt_state))
    out["trainable_plus_optimizer_bytes"] = out["trainable_bytes"] + out["optimizer_state_bytes"]
    out["frozen_base_bytes"] = _nbytes(lora.base_of(self.params)) if self.is_lora else 0
    out["step_program"] = dict(shape=step.purpose, **{
        k + "_bytes": getattr(m, k + "_size_in_bytes")
        for k in ("argument", "output", "temp", "alias", "generated_code")})
    return out

  @property
  def is_lora(self) -> bool:
    return isinstance(self.params, lora.LoraParams)

  def learner_step(self) -> None:
    self.params, self.opt_state, metrics = learner.train_step(
        self.params, self.opt_state, self.batch, **self.step_options)
    jax.block_until_ready((self.params, self.opt_state, metrics))

  def rollout_copy(self, engine) -> None:
    jax.block_until_ready(engine.rollout_copy_program(self.state.mesh)(self.params))

  def adapter_products(self, rows: int):
    """A call of the adapter products an unmerged decode step would add: for `rows`
    tokens, scale * (x A) B of every layer and target, in the sampler's dtype."""
    dtype = config_lib.dtype_from_name(self.state.model_cfg.dtype)  # the engine's cast
    rng = np.random.default_rng(0)
    factors, inputs = [], []
    for targets in self.params.adapters["layers"].values():
      for ab in targets.values():
        L, r = ab["a"].shape[0], ab["a"].shape[-1]
        a_LxIxr, b_LxrxO = ab["a"].reshape(L, -1, r), ab["b"].reshape(L, r, -1)
        factors.append((a_LxIxr.astype(dtype), b_LxrxO.astype(dtype)))
        inputs.append(jnp.asarray(rng.normal(size=(rows, a_LxIxr.shape[1])), dtype))
    scale = self.params.scale
    products = jax.jit(lambda fs, xs: [scale * jnp.einsum("lnr,lro->lno", jnp.einsum(
        "ni,lir->lnr", x_NxI, a_LxIxr), b_LxrxO) for (a_LxIxr, b_LxrxO), x_NxI in zip(fs, xs)])
    return lambda: products(factors, inputs)


def _interleaved(runs: dict, call, repeats: int) -> dict:
  """{run: median seconds of `repeats` calls of call(run)} after one warm-up call each,
  the runs' calls taking turns."""
  return bench_attention.interleaved_medians(
      {name: lambda run=run: call(run) for name, run in runs.items()},
      {name: () for name in runs}, repeats)


def _shapes(config, model_cfg) -> dict:
  rows = config.train.batch_questions * config.rollout.k
  per_mini = -(-rows // config.optim.mini_batches)
  return dict(
      model=dict(layers=model_cfg.num_layers, hidden=model_cfg.hidden_size,
                 intermediate=model_cfg.intermediate_size, heads=model_cfg.num_heads,
                 kv_heads=model_cfg.num_kv_heads, head_dim=model_cfg.head_dim,
                 vocab=model_cfg.vocab_size,
                 params=model_cfg.num_params(), dtype=model_cfg.dtype,
                 param_dtype=model_cfg.param_dtype, remat=model_cfg.remat),
      batch_questions=config.train.batch_questions, k=config.rollout.k, rollout_rows=rows,
      max_prompt_tokens=config.data.max_prompt_tokens,
      max_new_tokens=config.rollout.max_new_tokens,
      mini_batches=config.optim.mini_batches, rows_per_mini_batch=per_mini,
      micro_batch_size=config.optim.micro_batch_size,
      micro_batches=-(-per_mini // config.optim.micro_batch_size),
      learner_row_tokens=(padding.prompt_bucket(config.data.max_prompt_tokens,
                                                config.train.prompt_bucket)
                          + config.rollout.max_new_tokens),
      packing=config.train.packing, logprob_chunk=config.train.logprob_chunk,
      lora=dict(alpha=config.model.lora.alpha, targets=list(config.model.lora.targets),
                base_quant=config.model.lora.base_quant),
      rollout_scheduler=config.rollout.scheduler, rollout_max_rows=config.rollout.max_rows)


def _measure(runs: dict, repeats: int) -> dict:
  """The learner's and the sampler's figures of every run (see the module docstring)."""
  first = next(iter(runs.values()))
  config, st = first.config, first.state
  N = config.rollout.max_new_tokens
  learner_runs, sampler_runs = {}, {}
  for name, run in runs.items():
    _log(f"{name}: compiling the learner step for its memory analysis")
    learner_runs[name] = run.memory()
  _log("timing the learner step")
  step_s = _interleaved(runs, lambda run: run.learner_step(), repeats)
  full = learner_runs["full"]
  for name, seconds in step_s.items():
    learner_runs[name].update(
        step_s=seconds, training_step_s=seconds * config.optim.mini_batches,
        step_over_full=seconds / step_s["full"],
        trainable_plus_optimizer_over_full=(learner_runs[name]["trainable_plus_optimizer_bytes"]
                                            / full["trainable_plus_optimizer_bytes"]))

  r = config.rollout
  engine = sampling.make_engine("jax", st.model_cfg, st.tokenizer, ignore_eos=True,
                                max_rows=r.max_rows or None, scheduler=r.scheduler,
                                kv_pages=r.kv_pages or None, kv_headroom=r.kv_headroom)
  _log("timing the rollout copy")
  copy_s = _interleaved(runs, lambda run: run.rollout_copy(engine), repeats)
  prompts = [p.ids for p in st.prompts[:config.train.batch_questions] for _ in range(r.k)]
  _log(f"timing the adapter products of one decode step at {len(prompts)} rows")
  products = {name: run.adapter_products(len(prompts)) for name, run in runs.items()
              if run.is_lora}
  unmerged_s = bench_attention.interleaved_medians(
      products, {name: () for name in products}, repeats)
  for name, run in runs.items():
    _log(f"{name}: timing decode at {len(prompts)} rows")
    compiles = engine.stats["compiles"]
    ours = bench_sampler.bench_ours(st.model_cfg, run.params, st.tokenizer, prompts, N,
                                    repeats, engine=engine)
    decode_s = ours["decode_step_ms"] / 1e3
    merge_s = copy_s[name] if run.is_lora else 0.0
    sampler_runs[name] = dict(
        rollout_copy_s=copy_s[name], rollout_copy_over_full=copy_s[name] / copy_s["full"],
        merge_s=merge_s, merge_added_over_full_copy_s=copy_s[name] - copy_s["full"],
        merge_per_decode_step_s=merge_s / N,
        # None where the two lengths' noise left no positive difference (a tiny model)
        merge_per_decode_step_over_decode_step=merge_s / N / decode_s if decode_s > 0 else None,
        decode_step_s=decode_s, generate_s=ours["seconds"],
        decode_programs_compiled=engine.stats["compiles"] - compiles,
        adapter_cost_per_decode_step_s=0.0,
        unmerged_adapter_per_decode_step_s=unmerged_s.get(name, 0.0))
  return dict(
      shapes=_shapes(config, st.model_cfg),
      learner=dict(
          batch="one mini-batch at the config's worst case: every prompt at "
          "data.max_prompt_tokens, every response at rollout.max_new_tokens, packed as the "
          "trainer packs it; training_step_s is step_s x optim.mini_batches",
          runs=learner_runs),
      sampler=dict(
          path=MERGED_PATH, decode_steps_per_generate_call=N,
          definitions=dict(
              rollout_copy_s="the JAX engine's rollout-copy program (reshard and cast; with "
              "LoRA, the merge in the same program), run once per generate call",
              merge_s="LoRA: the whole rollout-copy program, the merge included; 0 for full "
              "fine-tuning, whose generate call pays rollout_copy_s without a merge",
              merge_added_over_full_copy_s="rollout_copy_s less full fine-tuning's",
              merge_per_decode_step_s="merge_s over the decode steps of one generate call "
              "(decode_steps_per_generate_call: rollout.max_new_tokens)",
              decode_step_s="(generate seconds at max_new_tokens less at max_new_tokens / 4) "
              "over the steps between, EOS ignored; every run decodes its rollout copy, "
              "which has the base's shapes and dtypes, with the same compiled program "
              "(decode_programs_compiled: 0 after the first run)",
              adapter_cost_per_decode_step_s="0 by construction: decode steps read the "
              "merged weights",
              unmerged_adapter_per_decode_step_s="what an unmerged decode would add to each "
              "decode step at the least: scale x (x A) B of every layer and target for the "
              "step's rows (rollout_rows), one jitted program in the model's compute dtype, "
              "median after a warm-up; 0 for full fine-tuning"),
          runs=sampler_runs))


def _bench() -> int:
  ranks = _ranks()
  if _REPEATS.value < 1:
    raise cli.UsageError(f"--repeats={_REPEATS.value}: must be at least 1")
  out = _OUT.value
  if out is not None and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
    raise cli.UsageError(f"--out={out}: no such directory")
  configs = _configs(ranks)
  config = _CONFIG.value
  started = datetime.datetime.now(datetime.timezone.utc)
  precision = models.matmul_precision(config.model.matmul_precision, config.model.dtype)
  with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp, \
      jax.default_matmul_precision(precision):
    runs = {}
    try:
      for name, run_config in configs.items():
        _log(f"{name}: loading")
        runs[name] = _Run(run_config, os.path.join(tmp, name))
      measured = _measure(runs, _REPEATS.value)
    finally:
      for run in runs.values():
        run.state.close()
  uname = platform.uname()
  result = dict(
      command=" ".join(["python", os.path.relpath(COMMAND[0], REPO)] + COMMAND[1:]),
      date_utc=started.strftime("%Y-%m-%dT%H:%M:%SZ"),
      machine=dict(processor=platform.processor() or uname.machine,
                   uname=" ".join([uname.system, uname.release, uname.machine]),
                   cpu_count=os.cpu_count(), jax_backend=jax.default_backend(),
                   devices=[d.device_kind for d in jax.devices()]),
      jax=jax.__version__,
      config=next((a.split("=", 1)[1] for a in COMMAND if a.startswith("--config=")),
                  DEFAULT_CONFIG),
      model=config.model.path or ("random_init" if config.model.random_init
                                  else "SmolLM2-135M-Instruct (embedded)"),
      repeats=_REPEATS.value,
      timing="median seconds of --repeats calls after one warm-up call (compile "
      "excluded), the runs' calls interleaved",
      **measured)
  text = json.dumps(result, indent=1)
  print(text)
  if out is not None:
    with open(out, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  return 0


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # Orbax's INFO lines would bury the progress
  sys.exit(cli.guarded(_bench, prefix="bench_lora"))


if __name__ == "__main__":
  app.run(main, flags_parser=config_cli.flags_parser(_CONFIG, "bench_lora"))
