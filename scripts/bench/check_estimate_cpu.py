r"""How far the step estimate sits from measured steps, on this CPU (JSON).

Shown in docs/aot.md ("How far to trust an estimate").

  python scripts/bench/check_estimate_cpu.py --config=configs/smollm2_study_v3.py \
      --config.algo.old_logp_source=recompute \
      --out=docs/results/estimate_check_cpu_study_v3.json
  python scripts/bench/check_estimate_cpu.py --config=configs/smollm2_study_v3.py \
      --config.algo.old_logp_source=recompute --config.rollout.max_new_tokens=128 \
      --config.rollout.max_rows=16 --config.data.source=file \
      --config.data.train_path=gsm8k_train.parquet \
      --out=docs/results/estimate_check_cpu_gsm8k_128.json

`python -m exgrpo_jax.aot plan --estimate` prices a step on a TPU or GPU from programs
compiled for it and a length distribution; nothing there runs. Here the same method is
set against a real run, with this CPU as the target:

1. `--warmup` + `--steps` training steps of the config, each step's prompt and response
   lengths and phase times recorded (`timing_s/gen`, `old_logprobs`, `update_actor`);
2. this CPU's roofline: its float32 matmul rate and memory bandwidth, measured before the
   steps and after each, the median of each (`targets.measured_rates`; `_cpu`), as a
   TPU's or GPU's peak FLOP/s and HBM bandwidth;
3. every program of the config's training step compiled for it (`check.run` with
   `targets.this_cpu`), as `exgrpo_jax.aot` compiles for an accelerator, with the
   longest prompt met as `data.max_prompt_tokens` (the trainer buckets the prompts it
   meets; the planner assumes the config's bound);
4. each measured step priced at its own lengths (`step_lengths.priced`): the rollout
   over its fresh rows, the recompute over them and the learner over every row the step
   trained on.

It prints, per phase, the median of measured / estimated seconds over the measured
steps, and whether the estimate ranks the phases as the measurements do (the JSON
holds every step). The warm-up steps compile and are left out; the load average is
recorded, since other work on the machine slows the measurements. This CPU does not
overlap compute with memory traffic (`targets.this_cpu`: a program's floor is the sum
of its FLOPs' and its bytes' times); `overlapped` prices the same steps as an
accelerator would (the larger of the two), to show what that rule changes.

  python scripts/bench/check_estimate_cpu.py \
      --reprice=docs/results/estimate_check_cpu_study_v3.json

prices a written JSON's recorded steps again with the estimator as it is now, from its
compiled programs' FLOPs and bytes and the median of its recorded rates (nothing
compiles or runs), and writes it back.
"""

import json
import os
import sys
import time

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from exgrpo_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import config_cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from scripts.bench import step_record  # pylint: disable=g-import-not-at-top,wrong-import-position

config_cli.make_config_files_importable(sys.argv)
_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.",
                                          lock_config=False)
_STEPS = flags.DEFINE_integer("steps", 6, "Measured steps.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 2, "Steps before them (compiles).", lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "Write the JSON here too.")
_REPRICE = flags.DEFINE_string("reprice", None, "A JSON this script wrote: price its "
                               "steps again (nothing runs) and write it back.")

def _priced(report: dict, overlap: bool) -> dict:
  """`report` with its target's `overlap` rule set, priced by it (`reprice.priced`)."""
  from exgrpo_jax.aot import reprice as reprice_lib  # pylint: disable=g-import-not-at-top
  return reprice_lib.priced(dict(report, target=dict(report["target"], overlap=overlap)))


def _cpu(gflops: list, gbps: list) -> dict:
  """This CPU's rates for the roofline from its readings (one before the steps, one after
  each): the medians. Other work on the machine lowers some readings and a quiet moment
  raises one (215 GFLOP/s once, beside six of 94-104), so neither the best nor the
  worst is the rate the steps ran at."""
  gflops, gbps = [round(r, 1) for r in gflops], [round(r, 1) for r in gbps]  # as recorded
  return dict(matmul_gflops_per_s=float(np.median(gflops)),
              bandwidth_gb_per_s=float(np.median(gbps)), statistic="median of the readings",
              measured_gflops_per_s=gflops, measured_gb_per_s=gbps)


def _rank(seconds: dict) -> list[str]:
  return sorted(step_record.PHASES, key=lambda p: -seconds[p])


def _compared(report: dict, recorded: list) -> dict:
  """The report priced by this CPU's rule, each recorded step (lengths and `measured_s`)
  with its estimates by that rule and `overlapped`, and their medians and rankings."""
  from exgrpo_jax.aot import step_lengths  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import targets  # pylint: disable=g-import-not-at-top
  report = _priced(report, targets.this_cpu(1.0, 1.0).overlap)
  overlapped = _priced(report, True)
  rows = [step | dict(estimated_s=step_lengths.priced(report, step),
                      overlapped_s=step_lengths.priced(overlapped, step)) for step in recorded]
  result = {}
  for key, name in (("estimated_s", ""), ("overlapped_s", "overlapped_")):
    result[f"{name}median_measured_over_estimated"] = {
        p: float(np.median([r["measured_s"][p] / r[key][p] for r in rows]))
        if all(r[key][p] > 0 for r in rows) else None for p in step_record.PHASES}
    result[f"{name}ranked_as_measured"] = [_rank(r["measured_s"]) == _rank(r[key])
                                           for r in rows]
    result[f"{name}estimated_ranking"] = _rank({p: np.median([r[key][p] for r in rows])
                                                for p in step_record.PHASES})
  result["measured_ranking"] = _rank({p: np.median([r["measured_s"][p] for r in rows])
                                      for p in step_record.PHASES})
  return result | dict(report=report, steps=rows)


def _write(result: dict, path: str | None) -> None:
  text = json.dumps(result, indent=1)
  print(text)
  if path:
    with open(path, "w", encoding="utf-8") as f:
      f.write(text + "\n")


def reprice(path: str, out: str | None) -> None:
  """`--reprice`: the JSON at `path` with its steps priced again, written to `out`."""
  try:
    with open(path, encoding="utf-8") as f:
      old = json.load(f)
  except (OSError, ValueError) as e:
    raise cli.UsageError(f"--reprice={path}: {cli.one_line(e)}") from None
  missing = [k for k in ("report", "steps") if not isinstance(old, dict) or k not in old]
  if missing:
    raise cli.UsageError(f"--reprice={path}: not a JSON this script wrote (no "
                         f"{' or '.join(missing)})")
  recorded = [{k: v for k, v in r.items() if k not in ("estimated_s", "overlapped_s")}
              for r in old["steps"]]
  cpu = old["cpu"] | _cpu(old["cpu"]["measured_gflops_per_s"], old["cpu"]["measured_gb_per_s"])
  report = dict(old["report"], target=dict(
      old["report"]["target"], peak_flops=cpu["matmul_gflops_per_s"] * 1e9,
      hbm_bandwidth=cpu["bandwidth_gb_per_s"] * 1e9))
  keep = ("command", "load_average", "date", "warmup_steps", "measured_steps")
  repriced = dict(repriced="python scripts/bench/check_estimate_cpu.py "
                  + " ".join(sys.argv[1:]), repriced_date=time.strftime("%Y-%m-%d"))
  _write({k: old[k] for k in keep if k in old} | dict(cpu=cpu) | repriced
         | _compared(report, recorded), out or path)


def main(argv):
  del argv
  sys.exit(cli.guarded(_main, prefix="check_estimate_cpu"))


def _main():
  logging.set_verbosity(logging.WARNING)
  if _REPRICE.value:
    return reprice(_REPRICE.value, _OUT.value)
  if _CONFIG.value is None:
    raise cli.UsageError("--config: a training config file is needed (or --reprice)")
  from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import targets  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.training import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  config = _CONFIG.value
  load_before = os.getloadavg()
  if _OUT.value:
    cli.check_writable(_OUT.value)
  total = _WARMUP.value + _STEPS.value
  config.train.steps, config.train.checkpoint_every, config.eval.every = total, total + 1, 0
  model_cfg = check.model_config(config)
  rates = [targets.measured_rates(model_cfg.hidden_size, model_cfg.intermediate_size)]
  steps, measured = [], []
  with tempfile.TemporaryDirectory(prefix="check_estimate_") as tmp:
    trainer = trainer_lib.Trainer(config, tmp)
    step_record.record(trainer, steps)
    for step in range(1, total + 1):
      start = time.time()
      metrics = trainer.train_step()
      print(f"[check] step {step}/{total}: {time.time() - start:.1f} s", file=sys.stderr,
            flush=True)
      measured.append(step_record.seconds(metrics))
      rates.append(targets.measured_rates(model_cfg.hidden_size, model_cfg.intermediate_size))
    trainer.close()
  # The programs at the shapes the steps ran: the trainer buckets the longest prompt it
  # meets, which the config's max_prompt_tokens only bounds.
  config.data.max_prompt_tokens = max(max(s["prompt_lens"]) for s in steps)
  cpu = _cpu([r[0] / 1e9 for r in rates], [r[1] / 1e9 for r in rates])
  peak, bandwidth = cpu["matmul_gflops_per_s"] * 1e9, cpu["bandwidth_gb_per_s"] * 1e9
  target = targets.this_cpu(peak, bandwidth)
  print(f"[check] this CPU: {peak / 1e9:.1f} GFLOP/s (float32 matmul), "
        f"{bandwidth / 1e9:.1f} GB/s; compiling the step's programs for it", file=sys.stderr,
        flush=True)
  report = check.run(config, "cpu", target=target, progress=lambda _: None)
  if not report["ok"]:
    raise RuntimeError(report["first_failure"])
  recorded = [step | dict(measured_s=seconds)
              for step, seconds in list(zip(steps, measured))[_WARMUP.value:]]
  _write(dict(
      command="python scripts/bench/check_estimate_cpu.py " + " ".join(sys.argv[1:]),
      load_average=dict(before=load_before, after=os.getloadavg()),
      date=time.strftime("%Y-%m-%d"),
      cpu=dict(device_kind=target.device_kind, devices=target.devices) | cpu,
      warmup_steps=_WARMUP.value, measured_steps=len(recorded))
         | _compared(report, recorded), _OUT.value)


if __name__ == "__main__":
  app.run(main, flags_parser=config_cli.flags_parser(_CONFIG, "check_estimate_cpu"))
