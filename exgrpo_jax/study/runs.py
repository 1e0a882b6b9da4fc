"""A study's runs: one training process each, resumable, and the summary of a finished one.

  status = runs.train(config, out, arm, seed, python)   # `<out>/<arm>_s<seed>`, train.log
  summary = runs.summarize_run(config, workdir, arm, seed)

Each run is `python -m exgrpo_jax.train` on the study's training config with its arm's
variant and overrides, the seed and the study's `run_overrides`, from the repository
root; it resumes from its workdir's checkpoint when there is one. The on-policy variant's
runs also evaluate the untrained model (step 0), which every arm of a seed shares (the
same weights and evaluation key). `commits.txt` in the workdir collects the commit of
every start. A summary holds the figures the report needs (a few KB), so that the
checkpoints can go.
"""

import json
import os
import signal
import subprocess
import threading

import numpy as np

from exgrpo_jax.study import protocol

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A run's step curves in its summary: name -> metrics.jsonl key.
CURVES = (("fresh_solved", "batch/fresh_solved"), ("entropy", "actor/entropy"),
          ("length", "response_length/mean"), ("on_ratio_max", "actor/on_ratio_max"),
          ("off_ratio_max", "actor/off_ratio_max"), ("grad_norm", "actor/grad_norm"),
          ("buffered", "experience/questions"), ("replayed", "experience/batch_size"),
          ("retired", "experience/retired"), ("solve_none", "batch/solve_none"),
          ("solve_all", "batch/solve_all"), ("step_s", "timing_s/step"))


def workdir(out: str, arm: str, seed: int) -> str:
  return os.path.join(out, f"{arm}_s{seed}")


def commit() -> str:
  """The repository's commit, `+dirty` with uncommitted changes to tracked files."""
  head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                        text=True, check=False).stdout.strip() or "unknown"
  dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                         capture_output=True, text=True, check=False).stdout.strip()
  return head + ("+dirty" if dirty else "")


def command(config, out: str, arm: str, seed: int, python: str, extra=()) -> list[str]:
  """The training command of one run; `extra`: more `key=value` overrides."""
  variant, overrides = protocol.arms(config)[arm]
  cmd = [python, "-m", "exgrpo_jax.train",
         f"--config={os.path.join(ROOT, config.train_config)}:{variant}",
         f"--config.train.seed={seed}", f"--workdir={workdir(out, arm, seed)}"]
  cmd += [f"--config.{kv}" for kv in (*config.run_overrides, *overrides)]
  if variant == "onpolicy":  # the step-0 evaluation, shared by every arm of the seed
    cmd.append("--config.eval.before_train=True")
  return cmd + [f"--config.{kv}" for kv in extra]


def train(config, out: str, arm: str, seed: int, python: str, env: dict | None = None,
          extra=(), timeout: float | None = None) -> int:
  """One run (resuming if its workdir has a checkpoint); its exit status. `env`: its
  environment; past `timeout` seconds it is killed (subprocess.TimeoutExpired) and
  resumes next time. Ctrl-C (which reaches the run too) and a SIGTERM to this process
  (passed on to the run) stop it as the trainer stops: checkpointed, exit status 75."""
  wd = workdir(out, arm, seed)
  os.makedirs(wd, exist_ok=True)
  with open(os.path.join(wd, "commits.txt"), "a", encoding="utf-8") as f:
    f.write(commit() + "\n")
  with open(os.path.join(wd, "train.log"), "a", encoding="utf-8") as log:
    proc = subprocess.Popen(command(config, out, arm, seed, python, extra), cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(
        signal.SIGTERM)) if main else None
    try:
      return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
      raise
    except KeyboardInterrupt:  # the run has its own Ctrl-C: it checkpoints, then exits
      return proc.wait()
    finally:
      if main:
        signal.signal(signal.SIGTERM, previous)


def summarize_run(config, wd: str, arm: str, seed: int) -> dict:
  """The figures the report needs from a finished run's metrics.jsonl. The health keys
  keep v3's names (`health.step` = 10 there): buffered questions at `health.step`, and the
  mean replayed / buffered over the steps after it."""
  from exgrpo_jax.training import run_log  # pylint: disable=g-import-not-at-top
  rows = {r["step"]: r for r in run_log.read_metrics(wd)}  # a resumed step counts once
  steps = [rows[s] for s in sorted(rows) if s > 0]
  evals = {str(s): {"avg@2": r["val/avg_score"], "greedy": r["val/greedy_score"]}
           for s, r in sorted(rows.items()) if "val/avg_score" in r}
  curve = lambda key: [r.get(key, 0.0) for r in steps]
  buffered = np.array(curve("experience/questions"))
  replayed = np.array(curve("experience/batch_size"))
  late = slice(config.health.step, max(config.eval_steps))
  replay_steps = [r for r in steps if r.get("experience/batch_size", 0) > 0]
  with open(os.path.join(wd, "commits.txt"), encoding="utf-8") as f:
    commits = sorted(set(f.read().split()))
  return {
      # For reading by hand: answers right only by a "last number" accident.
      "correct_at_40": correct_samples(wd, step=max(config.eval_steps)),
      "arm": arm, "seed": seed, "commits": commits, "evals": evals,
      "overrides": list(protocol.arms(config)[arm][1]),
      "health": {
          "buffered_at_10": int(rows[config.health.step].get("experience/questions", 0)),
          "replay_share_11_40": float(np.mean(replayed[late] / np.maximum(buffered[late], 1))),
          "replay_solve_all": (float(np.mean([r["experience/replay_solve_all"]
                                              for r in replay_steps])) if replay_steps else None),
      },
      # Groups with all K rewards equal have zero advantage (binary rewards).
      "zero_advantage_share": float(np.mean([r["batch/solve_all"] + r["batch/solve_none"]
                                             for r in steps])),
      "curves": {name: curve(key) for name, key in CURVES},
  }


def correct_samples(wd: str, step: int, limit: int = 50) -> list[dict]:
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


def write_summary(config, out: str, summaries: str, arm: str, seed: int) -> str:
  """Summarizes a finished run into `<summaries>/<arm>_s<seed>.json` (written whole, then
  renamed into place, so a kill leaves no half summary); its path."""
  os.makedirs(summaries, exist_ok=True)
  path = os.path.join(summaries, f"{arm}_s{seed}.json")
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(summarize_run(config, workdir(out, arm, seed), arm, seed), f, indent=1)
  os.replace(path + ".tmp", path)
  return path
