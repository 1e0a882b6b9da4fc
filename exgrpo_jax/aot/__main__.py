r"""Does a config fit a TPU slice or GPU node, and how long is its step: compiled here.

  python -m exgrpo_jax.aot --config=configs/qwen7b.py --target=v5p-8 \
      [--config.mesh.shape='(2, 2)' --config.rollout.max_rows=384 ...] [--layers=2] \
      [--parts=learner] [--out=aot.json]
  python -m exgrpo_jax.aot plan --config=configs/qwen7b.py --target=v5p-8 --out=plan.json
  python -m exgrpo_jax.aot plan --render docs/results/aot_*.json [--estimate]

Run it in an environment with the target's compiler (`bash scripts/accelerator/aot_env.sh tpu` or
`gpu`; docs/aot.md). The first form compiles every program of the config's training
step as it is: one row per program (compile time, peak memory per device against the
usable memory, FLOPs, collectives, a roofline estimate), the JSON report to --out, and
exit 1 naming the first program that does not compile or does not fit (0 when all do;
2 on a bad flag or config key). `--layers=N` compiles N of the model's layers, a quick
look whose memory and time are not the whole model's: it says so and gives no step
estimate. `plan` searches the mesh, micro-batch, rollout slots and KV pool that fit
(`plan_cli`, `plan`).
"""

import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from exgrpo_jax import cli
from exgrpo_jax import config_cli
from exgrpo_jax.aot import targets


config_cli.make_config_files_importable(sys.argv)
_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.",
                                          lock_config=True)
_TARGET = flags.DEFINE_enum("target", None, [*targets.TARGETS, targets.CPU],
                            "Machine to compile for (cpu: this host).")
_LAYERS = flags.DEFINE_integer("layers", None, "Compile with this many layers (quick looks).",
                               lower_bound=1)
_SLICES = flags.DEFINE_integer("slices", 1, "TPU slices (multi-slice).", lower_bound=1)
_TARGET_CONFIG = flags.DEFINE_string(
    "target_config", None, "GPU: a GpuTargetConfigProto text file captured on the GPU "
    "(default: the spec the installed CUDA plugin carries).")
_PARTS = flags.DEFINE_multi_enum("parts", ["learner", "rollout"], ["learner", "rollout"],
                                 "Compile the learner's programs, the rollout's, or both.")
_OUT = flags.DEFINE_string("out", None, "Write the JSON report here.")
_DEBUG = flags.DEFINE_bool("debug", False, "Show an error's traceback instead of one line.")
flags.mark_flags_as_required(["config", "target"])

GIB = 2 ** 30
_HEADER = ("program", "compile s", "peak GiB", "+ beside", "usable", "args", "temp",
           "TFLOP/dev", "XLA TFLOP", "collectives", "roofline ms", "calls/step")


def table(report: dict) -> str:
  """The report's programs as an aligned text table."""
  rows = [_HEADER]
  partial = report.get("partial")
  for p in report["programs"]:
    if p["error"]:
      rows.append((p["name"], f"{p['compile_s']:.1f}") + ("-",) * (len(_HEADER) - 2))
      continue
    collectives = " ".join(f"{k}:{v}" for k, v in sorted(p["collectives"].items())) or "-"
    rows.append((
        p["name"] + ("" if p["fits"] else " (margin)" if p["fits_without_margin"]
                     else " (!)"), f"{p['compile_s']:.1f}",
        f"{p['peak_bytes'] / GIB:.2f}", f"{p['device_peak_bytes'] / GIB:.2f}",
        f"{p['usable_bytes'] / GIB:.2f}",
        f"{p['argument_bytes'] / GIB:.2f}", f"{p['temp_bytes'] / GIB:.2f}",
        f"{p['flops_per_device'] / 1e12:.3g}", f"{p['xla_flops'] / 1e12:.3g}", collectives,
        f"{p['roofline_s'] * 1e3:.3g}", f"{p['calls_per_step']:.4g}"))
  widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
  for p in report["programs"]:
    if p["error"]:
      lines.append(f"{p['name']}: {p['error']}")
  estimate = report["step_estimate"]
  if partial:
    lines.insert(0, f"{partial} compiled: memory and time not for the whole model (no "
                 "verdict on its fit, no step estimate; drop --layers for them)")
    lines.append(f"{partial} compiled: the figures above are not the whole model's")
  elif estimate is None:
    lines.append("no estimate of one training step: it lacks "
                 + ", ".join(report["step_estimate_lacks"]) + " (not compiled or not fitting)")
  else:
    lines.append("roofline estimate of one training step (a lower bound, not a timing): "
                 + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in estimate.items()))
  return "\n".join(lines)


def main(argv):
  del argv  # the flags parser refused any positional argument
  targets.prepare_environment()

  def check() -> int:
    from exgrpo_jax.aot import check as check_lib  # pylint: disable=g-import-not-at-top
    if _OUT.value:
      cli.check_writable(_OUT.value)
    target_config = None
    if _TARGET_CONFIG.value:
      try:
        with open(_TARGET_CONFIG.value, encoding="utf-8") as f:
          target_config = f.read()
      except (OSError, UnicodeDecodeError) as e:
        raise cli.UsageError(f"--target_config={_TARGET_CONFIG.value}: "
                             f"{getattr(e, 'strerror', None) or e}") from None
    report = check_lib.run(_CONFIG.value, _TARGET.value, layers=_LAYERS.value,
                           target_config=target_config, slices=_SLICES.value,
                           parts=tuple(_PARTS.value),
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(table(report), flush=True)
    if _OUT.value:
      check_lib.save(report, _OUT.value)
    if not report["ok"]:
      return cli.error(report["first_failure"], prefix="exgrpo_jax.aot")
    return 0

  sys.exit(cli.guarded(check, debug=_DEBUG.value, prefix="exgrpo_jax.aot"))


if __name__ == "__main__":
  if sys.argv[1:2] == ["plan"]:
    from exgrpo_jax.aot import plan_cli  # pylint: disable=g-import-not-at-top
    sys.exit(plan_cli.main(sys.argv[2:]))
  app.run(main, flags_parser=config_cli.flags_parser(_CONFIG, "exgrpo_jax.aot"))
