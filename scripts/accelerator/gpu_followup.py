r"""What one GPU measures beyond the accelerator check, in one command that a rerun finishes.

How to run it: docs/developers/device_hour.md; its study is the GPU replicate
docs/results.md names, reported by `python -m exgrpo_jax.study report`. It has no
published result yet.

  python scripts/accelerator/gpu_followup.py --out $OUT/followup.json \
      [--parts lora,decode,study] [--budget lora=300,decode=170,study=330] [--jobs 6] \
      [--workdir /tmp/gpu_followup]
  python scripts/accelerator/gpu_followup.py --smoke --out /tmp/followup.json  # CPU, 1 step

lora    the committed one-GPU LoRA plan of Qwen2.5-Math-7B for this device (h200x1 or
        h100x1) at its settings, random weights of its shape, a few training steps at a
        fixed response length: the device's peak memory per phase and each phase's
        seconds beside the plan's (scripts/accelerator/gpu_lora.py, in a process of its
        own, which frees the device for the parts after it).
decode  the JAX engine's bfloat16 tokens/s (EOS ignored, 128 new tokens) and decode-only
        rate for SmolLM2-135M-Instruct and the Qwen2.5-1.5B shape at batch 1, 8, 64 and
        256 (`MEASUREMENTS`, most telling first), under each of `VARIANTS` (XLA's
        default flags, command buffers off, loops recorded as CUDA graphs), for the
        static loop and continuous batching at 16 and 64 decode steps a chunk; each
        variant in a process of its own (XLA reads its flags once), a share of the
        budget each; the HBM bound beside each (`bench_sampler.bandwidth_bound`).
study   evidence v3's primary pair, the protocol of configs/study_v3.py unchanged, for
        seeds 1, 2, ... with `--jobs` runs at once on the one device (each with its
        share of the memory), until the budget, through the study runner
        (exgrpo_jax/study): one summary per finished run, as the CPU study writes them, in
        `<dir of --out>/study_gpu_runs/`, which `python -m exgrpo_jax.study report
        --summaries` reads. A replicate of its own: never pooled with the CPU runs.

The JSON is rewritten after every measurement and run. A rerun with the same --out
skips what it holds; a run cut at the budget resumes from its checkpoint in --workdir
when the machine is the same (checkpoints never go under --out: 1.4 GB each).
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from exgrpo_jax import cli  # pylint: disable=wrong-import-position
from scripts.accelerator import accelerator_check  # pylint: disable=wrong-import-position

ALL_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
VARIANTS = {
    "default": "",
    "command_buffers_off": "--xla_gpu_enable_command_buffer=",
    "loops_as_graphs": f"--xla_gpu_enable_command_buffer={ALL_TYPES},CONDITIONAL,WHILE "
                       "--xla_gpu_graph_min_graph_size=1",
}
ENGINES = {"static": dict(scheduler="static"),
           "chunk16": dict(scheduler="continuous", chunk_steps=16),
           "chunk64": dict(scheduler="continuous", chunk_steps=64)}
MEASUREMENTS = [(model, batch, engine) for model, batch in (
    ("smollm2", 1), ("smollm2", 8), ("qwen", 1), ("smollm2", 64), ("qwen", 64),
    ("smollm2", 256), ("qwen", 8), ("qwen", 256)) for engine in ENGINES]
NEW_TOKENS, REPEATS = 128, 3
BUDGETS_S = dict(lora=300, decode=170, study=330)
LORA_GRACE_S = 150  # a step started before the budget ends after it: then killed
STUDY_CONFIG = os.path.join(ROOT, "configs", "study_v3.py")


def key(variant: str, model: str, batch: int, engine: str) -> str:
  return f"{variant}/{model}/b{batch}/{engine}"


def decode_child(variant: str, deadline_s: float, done: set, smoke: bool) -> None:
  """Runs in a process with the variant's XLA_FLAGS: one JSON line per measurement."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from scripts.accelerator import accelerator_parts as parts  # pylint: disable=g-import-not-at-top
  from scripts.bench import bench_sampler  # pylint: disable=g-import-not-at-top
  end = time.monotonic() + deadline_s
  ctx = parts.Context(smoke=smoke, tests=(), tests_log="", workdir="/tmp")
  new_tokens, repeats = (4, 1) if smoke else (NEW_TOKENS, REPEATS)
  bandwidth = bench_sampler.bound_bandwidth_gbs(repeats)["bound_bandwidth_gb_per_s"]
  for model, batch, engine in MEASUREMENTS:
    name = key(variant, model, batch, engine)
    if name in done or (smoke and batch > 8):
      continue
    if time.monotonic() > end:
      print(json.dumps(dict(key=name, skipped="budget")), flush=True)
      continue
    subject = ctx.subject(model)
    cfg = subject.cfg.replace(dtype="bfloat16")
    prompts = bench_sampler.chat_prompts(subject.tokenizer, batch)
    try:
      ours = bench_sampler.bench_ours(cfg, subject.params, None, prompts, new_tokens,
                                      repeats, **ENGINES[engine])
    except Exception as e:  # pylint: disable=broad-except
      print(json.dumps(dict(key=name, error=str(e).splitlines()[0][:300])), flush=True)
      continue
    context = float(np.mean([len(p) for p in prompts])) + new_tokens / 2
    bound = bench_sampler.bandwidth_bound(cfg, batch, context, bandwidth)
    print(json.dumps(dict(
        key=name, model=subject.name, batch=batch, engine=engine, xla_flags=VARIANTS[variant],
        tokens_per_s=ours["tokens_per_s"], decode_tokens_per_s=ours["decode_tokens_per_s"],
        decode_step_ms=ours["decode_step_ms"], compile_s=ours["compile_s"],
        hbm_bound_tokens_per_s=bound,
        decode_fraction_of_hbm_bound=ours["decode_tokens_per_s"] / bound)), flush=True)


def decode(report: dict, budget_s: float, smoke: bool, write) -> None:
  results = report.setdefault("decode", {})
  variants = list(VARIANTS)[:2] if smoke else list(VARIANTS)
  for i, variant in enumerate(variants):
    share = budget_s / len(variants)
    done = [k for k, v in results.items() if k.startswith(variant + "/") and "error" not in v
            and "skipped" not in v]
    env = dict(os.environ, XLA_FLAGS=" ".join(filter(None, (
        os.environ.get("XLA_FLAGS", ""), VARIANTS[variant]))))
    cmd = [sys.executable, __file__, "--decode-child", variant, "--child-deadline",
           str(share), "--done", ",".join(done)] + (["--smoke"] if smoke else [])
    print(f"[gpu_followup] decode {i + 1}/{len(variants)}: {variant} ({share:.0f} s)",
          file=sys.stderr, flush=True)
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True) as child:
      try:
        for line in child.stdout:
          if line.startswith("{"):
            row = json.loads(line)
            results[row.pop("key")] = row
            write()
      finally:
        child.kill()
    if child.returncode not in (0, -9):
      results[f"{variant}/process"] = dict(error=f"exit {child.returncode}")
      write()


def lora(report: dict, budget_s: float, out: str, workdir: str, smoke: bool, write) -> None:
  """scripts/accelerator/gpu_lora.py in a child process; its JSON as `report["lora"]`
  (skipped where that holds a finished step and no error)."""
  done = report.get("lora", {})
  if done.get("steps") and "error" not in done:
    return
  path = os.path.join(os.path.dirname(out), "gpu_lora.json")
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "accelerator", "gpu_lora.py"),
         "--out", path, "--budget", str(budget_s),
         "--workdir", os.path.join(workdir, "lora")] + (["--smoke"] if smoke else [])
  print(f"[gpu_followup] lora ({budget_s:.0f} s)", file=sys.stderr, flush=True)
  try:
    subprocess.run(cmd, cwd=ROOT, timeout=budget_s + LORA_GRACE_S, check=False)
    cut = False
  except subprocess.TimeoutExpired:
    cut = True
  try:
    with open(path, encoding="utf-8") as f:
      report["lora"] = json.load(f)
  except (OSError, ValueError) as e:
    report["lora"] = dict(error=f"no report from gpu_lora.py ({cli.one_line(e)})")
  if cut:
    report["lora"]["cut"] = f"killed {LORA_GRACE_S} s after its budget"
  write()


def study(report: dict, budget_s: float, jobs: int, summaries: str, workdir: str,
          smoke: bool, write) -> None:
  from exgrpo_jax.study import protocol  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.study import runs as study_runs  # pylint: disable=g-import-not-at-top
  config = protocol.load(STUDY_CONFIG)
  runs = report.setdefault("study", {"jobs": jobs, "runs": {}})["runs"]
  end = time.monotonic() + budget_s
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.9 / jobs:.3f}",
             XLA_PYTHON_CLIENT_PREALLOCATE="true")
  extra = ("train.steps=1", "eval.limit=4", "eval.every=1") if smoke else ()

  def one(arm, seed):
    left = end - time.monotonic()
    if left < 30:
      return "not started"
    try:
      status = study_runs.train(config, workdir, arm, seed, sys.executable, env=env,
                                extra=extra, timeout=left)
    except subprocess.TimeoutExpired:
      return "cut at the budget"
    if status:
      return f"exit {status}"
    if smoke:  # one step is no protocol run: nothing to summarize
      return "smoke step done"
    study_runs.write_summary(config, workdir, summaries, arm, seed)
    return "finished"

  # Seed by seed, both arms: pairs finish together.
  done = protocol.read_summaries(summaries)
  todo = [(arm, seed) for seed in range(1, 2 if smoke else 65) for arm in config.primary[::-1]
          if (arm, seed) not in done and runs.get(f"{arm}_s{seed}") != "smoke step done"]
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    futures = {pool.submit(one, *run): run for run in todo}
    for future in concurrent.futures.as_completed(futures):
      arm, seed = futures[future]
      state = future.result()
      if state != "not started":
        runs[f"{arm}_s{seed}"] = state
        print(f"[gpu_followup] study {arm} seed {seed}: {state}", file=sys.stderr, flush=True)
        write()


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", help="the JSON report (required)")
  parser.add_argument("--parts", default="lora,decode,study")
  parser.add_argument("--budget", default="", help="NAME=SECONDS,...")
  parser.add_argument("--jobs", type=cli.positive_int, default=6)
  parser.add_argument("--workdir", default="/tmp/gpu_followup")
  parser.add_argument("--smoke", action="store_true")
  parser.add_argument("--decode-child", help=argparse.SUPPRESS)
  parser.add_argument("--child-deadline", type=float, help=argparse.SUPPRESS)
  parser.add_argument("--done", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.smoke:
    os.environ["JAX_PLATFORMS"] = "cpu"
  if args.decode_child:
    decode_child(args.decode_child, args.child_deadline, set(filter(None,
                                                                    args.done.split(","))),
                 args.smoke)
    return
  if not args.out:
    parser.error("--out is required")
  parts = [p for p in args.parts.split(",") if p]
  unknown = [p for p in parts if p not in BUDGETS_S]
  if unknown:
    parser.error(f"--parts: unknown {', '.join(unknown)}; known: {', '.join(BUDGETS_S)}")
  budgets = dict(BUDGETS_S)
  for item in filter(None, args.budget.split(",")):
    name, _, seconds = item.partition("=")
    if name not in BUDGETS_S or not seconds.replace(".", "", 1).isdigit():
      parser.error(f"--budget {item}: give NAME=SECONDS with NAME in {', '.join(BUDGETS_S)}")
    budgets[name] = float(seconds)
  out = os.path.abspath(args.out)
  report = {}
  if os.path.exists(out):
    try:
      with open(out, encoding="utf-8") as f:
        report = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      parser.error(f"--out {args.out}: not a follow-up report to continue "
                   f"({cli.one_line(e)}); name a new file")
    if not isinstance(report, dict):
      parser.error(f"--out {args.out}: not a follow-up report to continue; name a new file")
  summaries = os.path.join(os.path.dirname(out), "study_gpu_runs")
  if "study" in parts:
    from exgrpo_jax.study import protocol  # pylint: disable=g-import-not-at-top
    try:
      protocol.read_summaries(summaries)
    except cli.UsageError as e:
      parser.error(str(e))
  os.makedirs(os.path.dirname(out), exist_ok=True)

  write = lambda: accelerator_check.write(out, report)
  if "lora" in parts:
    lora(report, budgets["lora"], out, args.workdir, args.smoke, write)
  if "decode" in parts:
    decode(report, budgets["decode"], args.smoke, write)
  if "study" in parts:
    study(report, budgets["study"], args.jobs, summaries, args.workdir, args.smoke, write)
  write()
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
