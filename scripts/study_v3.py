r"""Evidence v3, the pre-registered weak-model study (docs/results.md): run it, resumably.

  python scripts/study_v3.py run [--out runs/study_v3] [--summaries DIR] [--exploratory]
  python scripts/study_v3.py status [--summaries DIR]

`run` trains the protocol's runs one after another (configs/smollm2_study_v3.py, one
workdir `<out>/<arm>_s<seed>` each, its console in `train.log` there), and decides the
next stage by the rules below from the runs' own metrics. Stop it at any time (Ctrl-C,
SIGTERM) and run it again: a finished run is skipped, an unfinished one resumes from its
checkpoint, a crashed one is retried (never dropped or replaced). Once a run has
finished, its figures go to `<summaries>/<arm>_s<seed>.json` (default
docs/results/study_v3_runs, a few KB each, committed so that the study's state outlives
the machine it ran on) and its checkpoints are deleted (1.4 GB each). `status` prints
what is done and what comes next. The analysis (tables, verdict, figures) is
`scripts/study_v3_report.py`.

Protocol, fixed before the first run:
  Arms: `onpolicy` (Dr.GRPO) and `exgrpo` (rho 0.25) on every seed; on seeds 1-4 also
  `noreplay` (ExGRPO at rho 0: the mixed phase's unclipped fresh tokens and retirement,
  no replay) and `delayed` (ExGRPO with the paper's delayed start, batch accuracy
  > 0.35, clipped until then). `rho50` (the paper's share) on seeds 1-4 only with
  --exploratory, after everything else, reported as exploratory.
  Stage 1: seeds 1-4. If the SD of the paired AUC differences (exgrpo - onpolicy) is
  above 12 points, stop: not resolvable at this budget. Else stage 2: seeds 5-8.
  Health: an ExGRPO run passes with >= 5 buffered questions at step 10 and a mean of
  replayed / buffered questions <= 0.2 over steps 11-40. Unless 6 of the 8 pass, both
  arms are rerun at rho 0.125 with 8 questions a step (`onpolicy_b8`, `exgrpo_b8`), by
  the same stages.
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from exgrpo_jax.training import run_log  # pylint: disable=wrong-import-position

CONFIG = "configs/smollm2_study_v3.py"
SUMMARIES = "docs/results/study_v3_runs"
# arm: (variant, overrides)
ARMS = {
    "onpolicy": ("onpolicy", {}),
    "exgrpo": ("exgrpo", {}),
    "noreplay": ("noreplay", {}),
    "delayed": ("exgrpo", {"algo.delayed_start": 0.35}),
    "rho50": ("exgrpo", {"algo.rho": 0.5}),
    "onpolicy_b8": ("onpolicy", {"train.batch_questions": 8}),
    "exgrpo_b8": ("exgrpo", {"algo.rho": 0.125, "train.batch_questions": 8}),
}
PRIMARY = ("exgrpo", "onpolicy")
FALLBACK = ("exgrpo_b8", "onpolicy_b8")
ATTRIBUTION = ("noreplay", "delayed")
STAGE_SEEDS = ((1, 2, 3, 4), (5, 6, 7, 8))
EVAL_STEPS = (10, 20, 30, 40)  # the AUC's: mean held-out avg@2 over these
MAX_SD = 0.12          # stage rule: SD of paired AUC differences (accuracy units)
MIN_BUFFERED = 5       # health: buffered questions at step 10
MAX_REPLAY_SHARE = 0.2  # health: mean replayed / buffered over steps 11-40
MIN_HEALTHY = 6        # of 8 ExGRPO runs
RETRIES = 2            # a crashed run is resumed this many times before the driver stops


def workdir(out: str, arm: str, seed: int) -> str:
  return os.path.join(out, f"{arm}_s{seed}")


def summary(summaries: str, arm: str, seed: int) -> dict | None:
  path = os.path.join(summaries, f"{arm}_s{seed}.json")
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def auc(run: dict) -> float:
  return float(np.mean([run["evals"][str(s)]["avg@2"] for s in EVAL_STEPS]))


def healthy(run: dict) -> bool:
  h = run["health"]
  return h["buffered_at_10"] >= MIN_BUFFERED and h["replay_share_11_40"] <= MAX_REPLAY_SHARE


def summarize_run(wd: str, arm: str, seed: int) -> dict:
  """The figures the report needs from a finished run's metrics.jsonl."""
  rows = {r["step"]: r for r in run_log.read_metrics(wd)}  # a resumed step counts once
  steps = [rows[s] for s in sorted(rows) if s > 0]
  evals = {str(s): {"avg@2": r["val/avg_score"], "greedy": r["val/greedy_score"]}
           for s, r in sorted(rows.items()) if "val/avg_score" in r}
  curve = lambda key: [r.get(key, 0.0) for r in steps]
  buffered, replayed = np.array(curve("experience/questions")), np.array(
      curve("experience/batch_size"))
  late = slice(10, 40)  # steps 11-40
  replay_steps = [r for r in steps if r.get("experience/batch_size", 0) > 0]
  with open(os.path.join(wd, "commits.txt"), encoding="utf-8") as f:
    commits = sorted(set(f.read().split()))
  return {
      # For reading by hand: answers right only by a "last number" accident.
      "correct_at_40": _correct_samples(wd, step=max(EVAL_STEPS)),
      "arm": arm, "seed": seed, "commits": commits, "evals": evals,
      "health": {
          "buffered_at_10": int(rows[10].get("experience/questions", 0)),
          "replay_share_11_40": float(np.mean(replayed[late] / np.maximum(buffered[late], 1))),
          "replay_solve_all": (float(np.mean([r["experience/replay_solve_all"]
                                              for r in replay_steps])) if replay_steps else None),
      },
      # Groups with all K rewards equal have zero advantage (binary rewards).
      "zero_advantage_share": float(np.mean([r["batch/solve_all"] + r["batch/solve_none"]
                                             for r in steps])),
      "curves": {name: curve(key) for name, key in (
          ("fresh_solved", "batch/fresh_solved"), ("entropy", "actor/entropy"),
          ("length", "response_length/mean"), ("on_ratio_max", "actor/on_ratio_max"),
          ("off_ratio_max", "actor/off_ratio_max"), ("grad_norm", "actor/grad_norm"),
          ("buffered", "experience/questions"), ("replayed", "experience/batch_size"),
          ("retired", "experience/retired"), ("solve_none", "batch/solve_none"),
          ("solve_all", "batch/solve_all"), ("step_s", "timing_s/step"))},
  }


def _correct_samples(wd: str, step: int, limit: int = 50) -> list[dict]:
  """The first `limit` held-out completions graded correct at `step` (eval_samples.jsonl)."""
  path = os.path.join(wd, "eval_samples.jsonl")
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  correct = {(r["problem"], r["response"]): r for r in rows
             if r["step"] == step and r["reward"] > 0}  # a resumed evaluation counts once
  return [{k: r[k] for k in ("problem", "ground_truth", "response")}
          for r in list(correct.values())[:limit]]


def paired_sd(summaries: str, arms, seeds) -> float | None:
  """SD of the paired AUC differences, None until every pair has finished."""
  runs = [(summary(summaries, arms[0], s), summary(summaries, arms[1], s)) for s in seeds]
  if any(a is None or b is None for a, b in runs):
    return None
  return float(np.std([auc(a) - auc(b) for a, b in runs], ddof=1))


def plan(summaries: str, exploratory: bool) -> tuple[list, str]:
  """The (arm, seed) runs the rules call for now, in order, and the stage's state."""
  stage1 = [(arm, s) for s in STAGE_SEEDS[0] for arm in (*PRIMARY[::-1], *ATTRIBUTION)]
  todo = [r for r in stage1 if summary(summaries, *r) is None]
  if todo:
    return todo, "stage 1"
  sd = paired_sd(summaries, PRIMARY, STAGE_SEEDS[0])
  if sd > MAX_SD:
    return [], f"stopped after stage 1: paired AUC SD {100 * sd:.1f} > {100 * MAX_SD:.0f} points"
  pairs = PRIMARY
  stage2 = [(arm, s) for s in STAGE_SEEDS[1] for arm in PRIMARY[::-1]]
  todo = [r for r in stage2 if summary(summaries, *r) is None]
  if todo:
    return todo, "stage 2"
  seeds = STAGE_SEEDS[0] + STAGE_SEEDS[1]
  passing = sum(healthy(summary(summaries, "exgrpo", s)) for s in seeds)
  state = f"done: {passing} of 8 ExGRPO runs healthy"
  if passing < MIN_HEALTHY:
    pairs = FALLBACK
    todo = [(arm, s) for s in STAGE_SEEDS[0] for arm in FALLBACK[::-1]]
    todo = [r for r in todo if summary(summaries, *r) is None]
    if todo:
      return todo, f"fallback stage 1 ({passing} of 8 ExGRPO runs healthy)"
    sd = paired_sd(summaries, FALLBACK, STAGE_SEEDS[0])
    if sd <= MAX_SD:
      todo = [(arm, s) for s in STAGE_SEEDS[1] for arm in FALLBACK[::-1]]
      todo = [r for r in todo if summary(summaries, *r) is None]
      if todo:
        return todo, "fallback stage 2"
    state = "fallback done"
  if exploratory:
    todo = [("rho50", s) for s in STAGE_SEEDS[0] if summary(summaries, "rho50", s) is None]
    if todo:
      return todo, "exploratory rho50"
  return [], f"{state} (pairs {pairs[0]} - {pairs[1]})"


def commit() -> str:
  head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                        text=True, check=False).stdout.strip() or "unknown"
  dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                         capture_output=True, text=True, check=False).stdout.strip()
  return head + ("+dirty" if dirty else "")


def train(out: str, arm: str, seed: int, python: str, env: dict | None = None,
          extra: tuple = (), timeout: float | None = None) -> int:
  """One run (resuming if its workdir has a checkpoint); its exit status. `env`: its
  environment; `extra`: more `key=value` config overrides; past `timeout` seconds it is
  killed (subprocess.TimeoutExpired) and resumes next time."""
  wd = workdir(out, arm, seed)
  os.makedirs(wd, exist_ok=True)
  with open(os.path.join(wd, "commits.txt"), "a", encoding="utf-8") as f:
    f.write(commit() + "\n")
  variant, overrides = ARMS[arm]
  cmd = [python, "-m", "exgrpo_jax.train", f"--config={CONFIG}:{variant}",
         f"--config.train.seed={seed}", f"--workdir={wd}"]
  cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
  if variant == "onpolicy":  # the step-0 evaluation, shared by every arm of the seed
    cmd.append("--config.eval.before_train=True")
  cmd += [f"--config.{kv}" for kv in extra]
  with open(os.path.join(wd, "train.log"), "a", encoding="utf-8") as log:
    return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                          timeout=timeout, check=False).returncode


def run(args) -> None:
  os.makedirs(args.summaries, exist_ok=True)
  while True:
    todo, state = plan(args.summaries, args.exploratory)
    print(f"[study_v3] {state}: {len(todo)} run(s) to go", flush=True)
    if not todo:
      return
    arm, seed = todo[0]
    wd = workdir(args.out, arm, seed)
    for attempt in range(RETRIES + 1):
      print(f"[study_v3] {arm} seed {seed}" + (f" (retry {attempt})" if attempt else "")
            + f": {wd}/train.log", flush=True)
      status = train(args.out, arm, seed, args.python)
      if status == 0:
        break
      if status in (75, 130):  # stopped by a signal: checkpointed, resumes next time
        sys.exit(f"[study_v3] {arm} seed {seed} stopped (exit {status}); run again to resume")
    else:
      sys.exit(f"[study_v3] {arm} seed {seed} failed {RETRIES + 1} times (exit {status}); "
               f"see {wd}/train.log")
    with open(os.path.join(args.summaries, f"{arm}_s{seed}.json"), "w",
              encoding="utf-8") as f:
      json.dump(summarize_run(wd, arm, seed), f, indent=1)
    shutil.rmtree(os.path.join(wd, "checkpoints"), ignore_errors=True)


def status(args) -> None:
  done = sorted(os.path.basename(p)[:-len(".json")] for p in
                glob.glob(os.path.join(args.summaries, "*_s*.json")))
  todo, state = plan(args.summaries, args.exploratory)
  print(f"finished ({len(done)}): {' '.join(done) or '-'}")
  print(f"{state}; next: {' '.join(f'{a}_s{s}' for a, s in todo) or '-'}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("command", choices=("run", "status"))
  parser.add_argument("--out", default="runs/study_v3", help="the runs' workdirs")
  parser.add_argument("--summaries", default=SUMMARIES,
                      help="finished runs' figures, one JSON each")
  parser.add_argument("--exploratory", action="store_true",
                      help="also rho50 on seeds 1-4, after everything else")
  parser.add_argument("--python", default=sys.executable)
  args = parser.parse_args()
  args.out, args.summaries = os.path.abspath(args.out), os.path.abspath(args.summaries)
  (run if args.command == "run" else status)(args)


if __name__ == "__main__":
  main()
