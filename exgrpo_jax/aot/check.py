"""Compiles a config's training step for a target and reports each program (`run`).

The mesh is the config's (`config.mesh`, built by `sharding.make_mesh`) over the
target's compile-only devices; every program of `programs.training_step` is traced,
lowered and compiled under it, in order (later programs take earlier ones' outputs).
A program that fails to compile (or, on TPU, that the compiler refuses for want of
HBM) is recorded with its error, and the programs that need its outputs are skipped.
"""

import dataclasses
import json
import math
import re
import time

import jax

from exgrpo_jax import cli
from exgrpo_jax import models
from exgrpo_jax import sharding
from exgrpo_jax.aot import analysis
from exgrpo_jax.aot import flops
from exgrpo_jax.aot import programs as programs_lib
from exgrpo_jax.aot import targets
from exgrpo_jax.models import attention
from exgrpo_jax.models import published

GIB = 2 ** 30


def model_config(config, layers: int | None = None) -> models.ModelConfig:
  """The config's model: its local config.json, else the published architecture
  `model.path` names (`models.published`); `layers` cuts it to that many layers."""
  m = config.model
  if m.random_init:
    raise ValueError("model.random_init configs take their vocabulary from a tokenizer; "
                     "give exgrpo_jax.aot a config with a model.path")
  path = models.resolve_hf_dir(m.path or models.default_model_path()) if (
      not m.path or m.path.endswith(".gguf")) else m.path
  cfg = published.config_for(path, dtype=m.dtype, param_dtype=m.param_dtype,
                             remat=m.remat, attention=m.attention)
  return dataclasses.replace(cfg, num_layers=layers) if layers else cfg


def _abstract_outputs(compiled):
  """The compiled program's outputs as ShapeDtypeStructs with their shardings."""
  return jax.tree.map(
      lambda info, s: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=s),
      compiled.out_info, compiled.output_shardings)


def _error_line(e: BaseException) -> str:
  """The compiler's error on one line: libtpu's out-of-memory refusal as need > limit;
  else its first line, and the exception a wrapped traceback inside it ends in (XLA's
  custom partitioners report Python errors so)."""
  oom = re.search(r"CompileTimeHbmOom.*?\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)",
                  str(e))
  if oom:
    return f"CompileTimeHbmOom: {oom[1]} GiB needed > {oom[2]} GiB of HBM (libtpu's limit)"
  lines = [l.strip() for l in str(e).splitlines() if l.strip()]
  inner = [l for l in lines[1:] if re.match(r"[\w.]*(Error|Exception): ", l)]
  if inner:
    return f"{type(e).__name__}: {lines[0]} ... {inner[-1]}"
  return f"{type(e).__name__}: {cli.one_line(e)}"


def compile_program(program, outputs: dict, mesh, target) -> analysis.Result:
  """Traces, lowers and compiles `program`; records its figures in a Result."""
  result = analysis.Result(program.name, program.purpose,
                           usable_bytes=targets.usable_bytes(target),
                           margin_bytes=targets.margin_bytes(target),
                           calls_per_step=program.calls)
  try:
    args = program.args(outputs)
  except KeyError as e:
    result.error = f"skipped: needs {e.args[0]}, which did not compile"
    return result
  start = time.perf_counter()
  try:
    with sharding.use_mesh(mesh):
      traced = program.fn.trace(*args, **program.kwargs)
      compiled = traced.lower().compile()
  except Exception as e:  # pylint: disable=broad-except
    result.compile_s = time.perf_counter() - start
    result.error = _error_line(e)
    return result
  result.compile_s = time.perf_counter() - start
  outputs[program.name] = _abstract_outputs(compiled)
  memory = compiled.memory_analysis()
  result.peak_bytes = analysis.peak_bytes(memory)
  result.argument_bytes = memory.argument_size_in_bytes
  result.output_bytes = memory.output_size_in_bytes
  result.temp_bytes = memory.temp_size_in_bytes
  result.alias_bytes = memory.alias_size_in_bytes
  result.in_place = program.in_place
  result.resident_bytes = analysis.shard_bytes(program.resident(outputs))
  cost = analysis.xla_cost(compiled)
  result.xla_flops = float(cost.get("flops", 0.0))
  result.xla_bytes = float(cost.get("bytes accessed", 0.0))
  result.flops_per_device = flops.program_flops(program, traced) / mesh.size
  text = compiled.as_text()
  result.collectives = analysis.collectives(text)
  result.custom_calls = analysis.custom_calls(text)
  result.largest_copy_bytes = analysis.largest_copy_bytes(text)
  streamed = analysis.shard_bytes([args[i] for i in program.streamed[:-1]])
  if program.streamed:
    streamed += program.cache_share * analysis.shard_bytes([args[program.streamed[-1]]])
  analysis.roofline(result, streamed, program.steps, dataclasses.asdict(target))
  return result


LEARNER = ("learner_step", "score")  # the rest is the rollout's (and evaluation's)


def run(config, target_name: str, *, layers: int | None = None,
        target_config: str | None = None, slices: int = 1, parts=("learner", "rollout"),
        progress=print, target: targets.Target | None = None) -> dict:
  """Compiles every program of `config`'s training step for `target_name` (of the
  learner's and the rollout's `parts`), or for `target` so named (`targets.this_cpu`);
  the report."""
  target = target or targets.get(target_name)
  devices = targets.devices(target, target_config, slices)
  mesh = sharding.make_mesh(config.mesh, devices)
  kind = devices[0].device_kind
  attention.check_supported(config.model.attention, devices[0].platform, kind)
  cfg = model_config(config, layers)
  whole = model_config(config).num_layers
  if layers and layers > whole:
    raise cli.UsageError(f"--layers={layers}: the model has {whole} layers")
  progress(f"[aot] {target_name}: {len(devices)} x {kind}, mesh "
           f"{dict(mesh.shape)}, {cfg.num_layers} layers; usable "
           f"{targets.usable_bytes(target) / GIB:.2f} GiB per device")
  results, outputs = [], {}
  step_programs = programs_lib.training_step(config, cfg, mesh)
  precision = models.matmul_precision(config.model.matmul_precision, config.model.dtype)
  for program in step_programs:
    if ("learner" if program.name in LEARNER else "rollout") not in parts:
      continue
    progress(f"[aot] compiling {program.name}: {program.purpose} ...")
    with jax.default_matmul_precision(precision):  # the trainer's
      result = compile_program(program, outputs, mesh, target)
    results.append(result)
    progress("[aot]   " + (result.error or (
        f"{result.compile_s:.1f} s, peak {result.peak_bytes / GIB:.2f} GiB, with what "
        f"stays beside it {result.device_peak_bytes / GIB:.2f} GiB")))
  return report(config, cfg, target_name, target, mesh, results, slices,
                [p.name for p in step_programs], whole_layers=whole)


def step_estimate(results, step_names) -> tuple[dict | None, list[str]]:
  """(the roofline of one training step, by part; the programs of `step_names` it lacks:
  not compiled or not fitting). The estimate is None unless it lacks none: a step
  without its rollout's costliest programs is no step."""
  fit = {r.name for r in results if r.fits}
  lacking = [name for name in step_names if name not in fit]
  if lacking:
    return None, lacking
  step = {}
  for label, names in (("rollout", lambda n: n not in LEARNER),
                       ("old_logp_recompute", lambda n: n == "score"),
                       ("learner", lambda n: n == "learner_step")):
    step[label + "_s"] = sum(r.calls_per_step * r.roofline_s for r in results
                             if names(r.name))
  step["total_s"] = sum(step.values())
  return step, []


def report(config, cfg, target_name, target, mesh, results, slices, step_names,
           whole_layers: int | None = None) -> dict:
  """The JSON report: target, mesh, model, batch, every program, the step estimate
  (None, with the programs it lacks, unless every program of the step fits). `partial`
  says how many of the model's `whole_layers` were compiled where not all were: its
  figures are not the whole model's, and it has no step estimate."""
  failed = next((r for r in results if not r.fits), None)
  step, lacking = step_estimate(results, step_names)
  partial = None
  if whole_layers and cfg.num_layers < whole_layers:
    partial = f"{cfg.num_layers} of {whole_layers} layers"
    step, lacking = None, [f"the whole model ({partial} compiled)"]
  return dict(
      target=dict(name=target_name, slices=slices, **dataclasses.asdict(target)),
      mesh=dict(mesh.shape), devices=mesh.size, jax=jax.__version__,
      model=dict(layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads,
                 kv_heads=cfg.num_kv_heads, vocab=cfg.vocab_size, dtype=cfg.dtype,
                 param_dtype=cfg.param_dtype, remat=cfg.remat, attention=cfg.attention,
                 lora_rank=config.model.lora.rank,
                 params_billion=round(sum(math.prod(x.shape) for x in jax.tree.leaves(
                     models.abstract_params(cfg))) / 1e9, 3)),
      batch=dict(questions=config.train.batch_questions, k=config.rollout.k,
                 prompt_tokens=config.data.max_prompt_tokens,
                 response_tokens=config.rollout.max_new_tokens,
                 micro_batch_size=config.optim.micro_batch_size,
                 mini_batches=config.optim.mini_batches, packing=config.train.packing,
                 max_rows=config.rollout.max_rows, kv_pages=config.rollout.kv_pages),
      programs=[dataclasses.asdict(r) | dict(device_peak_bytes=r.device_peak_bytes,
                                             fits=r.fits,
                                             fits_without_margin=r.fits_without_margin)
                for r in results],
      partial=partial, ok=failed is None,
      first_failure=None if failed is None else failure_line(failed),
      step_estimate=step, step_estimate_lacks=lacking)


def failure_line(result: analysis.Result) -> str:
  """One line naming the program that does not compile or fit, with peak and limit."""
  if result.error:
    return f"{result.name} did not compile: {result.error}"
  need = (f"{result.device_peak_bytes / GIB:.2f} GiB per device (its peak "
          f"{result.peak_bytes / GIB:.2f} + {result.resident_bytes / GIB:.2f} kept beside it)")
  if result.fits_without_margin:
    return (f"{result.name} fits only without margin: {need} > "
            f"{(result.usable_bytes - result.margin_bytes) / GIB:.2f} GiB (usable "
            f"{result.usable_bytes / GIB:.2f} less the margin of "
            f"{result.margin_bytes / GIB:.2f})")
  return f"{result.name} does not fit: {need} > usable {result.usable_bytes / GIB:.2f} GiB"


def save(report_: dict, path: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(report_, f, indent=1)
    f.write("\n")
