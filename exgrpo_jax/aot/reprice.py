"""A written plan's FLOPs counted again, and its roofline with them (`reprice`).

  plan = reprice(json.load(open("docs/results/aot_qwen7b_v5p-8.json")))

A plan (`python -m exgrpo_jax.aot plan`) records each program's matmul FLOPs as the count
of its day had them. `reprice` traces the chosen settings' programs again for the plan's
target, without compiling them (seconds, not the minutes of a compile), counts their
FLOPs with `flops.matmul_flops`, and prices the programs' rooflines and the step
estimate with them (`priced`). The memory figures and the bytes per call are the
compiler's and stay as written. The programs are those of the code that traces them: a
plan whose programs differ from them is refused. Run it in the target's ahead-of-time
environment (.aot/tpu or .aot/gpu), after `targets.prepare_environment()`.
"""

import copy
import dataclasses
import time

import jax

from exgrpo_jax import config_cli
from exgrpo_jax import models
from exgrpo_jax import sharding
from exgrpo_jax.aot import analysis
from exgrpo_jax.aot import flops
from exgrpo_jax.aot import programs as programs_lib
from exgrpo_jax.aot import targets


def priced(report: dict) -> dict:
  """`report` (a copy) with every program's roofline and the step estimate priced from
  the programs' FLOPs and bytes by its target (`analysis.bound_s`, `check.step_estimate`)."""
  from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
  report = copy.deepcopy(report)
  fields = {f.name for f in dataclasses.fields(analysis.Result)}
  results = []
  for p in report["programs"]:
    p["roofline_s"] = float(analysis.bound_s(p["flops_per_device"], p["hbm_bytes_per_call"],
                                             report["target"]))
    results.append(analysis.Result(**{k: v for k, v in p.items() if k in fields}))
  report["step_estimate"], _ = check.step_estimate(results, [r.name for r in results])
  return report


def traced_flops(spec: str, report: dict) -> dict:
  """Each program's FLOPs per device (`flops.program_flops`), traced for `report`'s
  target at its mesh, micro-batch, slots and pool, the config file `spec` its config."""
  from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import plan as plan_lib  # pylint: disable=g-import-not-at-top
  target, b = targets.get(report["target"]["name"]), report["batch"]
  config = plan_lib.configured(
      spec, report["mesh"].get("tensor", 1), target.devices, b["micro_batch_size"],
      b["max_rows"], b["kv_pages"])
  mesh = sharding.make_mesh(config.mesh, targets.devices(
      target, slices=report["target"].get("slices", 1)))
  cfg = check.model_config(config)
  precision = models.matmul_precision(config.model.matmul_precision, config.model.dtype)
  counted, outputs = {}, {}
  for program in programs_lib.training_step(config, cfg, mesh):
    args = program.args(outputs)
    with sharding.use_mesh(mesh), jax.default_matmul_precision(precision):
      traced = program.fn.trace(*args, **program.kwargs)
    outputs[program.name] = traced.out_info
    counted[program.name] = flops.program_flops(program, traced) / mesh.size
  return counted


def reprice(plan: dict) -> dict:
  """`plan` (a copy) with its report's FLOPs per device counted again from a fresh trace
  (`traced_flops`), its rooflines and step estimate priced with them (`priced`), and the
  chosen mesh's `mid_step_s` in `settled` again; the counts it had, and the step
  estimate, under `repriced`. A plan that does not fit has no programs: returned as is,
its margin recorded.
  Raises ValueError where the plan's programs are not the ones traced."""
  from exgrpo_jax.aot import plan as plan_lib  # pylint: disable=g-import-not-at-top
  if not plan.get("fits") or "report" not in plan:
    return dict(copy.deepcopy(plan), margin_gib=plan_lib.margin_gib(plan))
  report = plan["report"]
  counted = traced_flops(plan["config"], report)
  written = [p["name"] for p in report["programs"]]
  if written != list(counted):
    raise ValueError(f"{plan['config']} on {plan['target']}: the plan's programs "
                     f"({', '.join(written)}) are not the ones traced now "
                     f"({', '.join(counted)}): plan it again")
  new = copy.deepcopy(report)
  for p in new["programs"]:
    p["flops_per_device"] = counted[p["name"]]
  new = priced(new)
  headroom = config_cli.load(plan["config"]).rollout.kv_headroom
  tensor = new["mesh"].get("tensor", 1)
  settled = [dict(s, mid_step_s=plan_lib.mid_step_s(dict(report=new, chosen=s), headroom))
             if s["tensor"] == tensor else s for s in plan.get("settled", [])]
  return dict(copy.deepcopy(plan), report=new, settled=settled,
              margin_gib=plan_lib.margin_gib(plan), repriced=dict(
      date=time.strftime("%Y-%m-%d"), jax=jax.__version__,
      flops_per_device_before={p["name"]: p["flops_per_device"]
                               for p in report["programs"]},
      step_estimate_before=report["step_estimate"],
      settled_not_repriced=[s["tensor"] for s in settled if s["tensor"] != tensor]))
