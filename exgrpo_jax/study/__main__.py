r"""A pre-registered paired study, run and reported: `python -m exgrpo_jax.study`.

  python -m exgrpo_jax.study run --config=configs/study_v3.py --out=runs/study_v3 \
      [--exploratory] [--python PY] [--smoke]
  python -m exgrpo_jax.study status --config=configs/study_v3.py --out=runs/study_v3
  python -m exgrpo_jax.study report --config=configs/study_v3.py --out=runs/study_v3 \
      [--summaries DIR] [--json PATH]

`run` trains the runs the study config's rules call for (exgrpo_jax/study/protocol.py),
one after another, in `<out>/<arm>_s<seed>` (console in `train.log` there), and decides
the next stage from the finished runs' own figures. Stop it at any time (Ctrl-C,
SIGTERM) and run it again: a finished run is skipped, an unfinished one resumes from
its checkpoint, a crashed one is retried (never dropped or replaced). A finished run's
summary goes to `<out>/summaries/<arm>_s<seed>.json` (a few KB) and its checkpoints are
deleted. `status` prints what is done and what comes next. `report` applies the rules
to the summaries (`--summaries`, default `<out>/summaries`: the committed study's are
docs/results/study_v3_runs) and writes `<out>/<name>.json` (or `--json`) and the
figures `<out>/<name>_*.png`. `--smoke` is the config's "smoke" variant: a pipeline
check of about a minute on a tiny model.

Exit status: 0 done; 2 a bad flag, config or summary file, an output that cannot be
written, or summaries with no paired result to report (one line naming it, before
anything is written); 1 a run that failed `retries + 1` times or another error; 75 a
run stopped by a signal (checkpointed: run the same command again).
"""

import argparse
import importlib.util
import json
import os
import shutil
import sys

from exgrpo_jax import cli
from exgrpo_jax.study import protocol
from exgrpo_jax.study import runs as runs_lib

PROG = "exgrpo_jax.study"


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog=f"python -m {PROG}",
                                   description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  for name, what in (("run", "train the runs the rules call for, resumably"),
                     ("status", "what is done and what comes next"),
                     ("report", "the paired statistics, verdict and figures")):
    p = sub.add_parser(name, help=what, description=what)
    p.add_argument("--config", required=True, help="a study config (configs/study_v3.py)")
    p.add_argument("--out", required=True, help="the study's directory (runs/...)")
    p.add_argument("--smoke", action="store_true", help="the config's tiny smoke variant")
    cli.add_debug_flag(p)
    if name in ("run", "status"):
      p.add_argument("--exploratory", action="store_true",
                     help="also the exploratory arms, after everything else")
    if name == "run":
      p.add_argument("--python", default=sys.executable, help="the runs' interpreter")
    if name == "report":
      p.add_argument("--summaries", help="finished runs' summaries (default <out>/summaries)")
      p.add_argument("--json", help="the report's JSON (default <out>/<name>.json)")
  return parser


def _check_out(out: str) -> None:
  """The committed results are never a study's own runs."""
  docs = os.path.join(runs_lib.ROOT, "docs")
  if os.path.commonpath([os.path.abspath(out), docs]) == docs:
    raise cli.UsageError(f"--out {out}: inside the committed docs/; name a directory of "
                         "your own (runs/...); `report --summaries` reads committed runs")


def _check_writable(flag: str, path: str, directory: bool) -> None:
  """An output that cannot be written is a bad flag, found before any work."""
  why = cli.unwritable(path, directory)
  if why:
    raise cli.UsageError(f"{flag} {path}: cannot write there ({why})")


def run(config, args) -> int:
  if not shutil.which(args.python):
    raise cli.UsageError(f"--python {args.python}: no such interpreter")
  _check_out(args.out)
  _check_writable("--out", args.out, directory=True)
  out, summaries = os.path.abspath(args.out), os.path.join(os.path.abspath(args.out),
                                                           "summaries")
  while True:
    finished = protocol.read_summaries(summaries)
    todo, state = protocol.plan(config, finished, args.exploratory)
    print(f"[study] {state}: {len(todo)} run(s) to go", flush=True)
    if not todo:
      print(f"[study] report: python -m {PROG} report --config={args.config} "
            f"--out={args.out}" + (" --smoke" if args.smoke else ""), flush=True)
      return 0
    arm, seed = todo[0]
    wd = runs_lib.workdir(out, arm, seed)
    for attempt in range(config.retries + 1):
      print(f"[study] {arm} seed {seed}" + (f" (retry {attempt})" if attempt else "")
            + f": {wd}/train.log", flush=True)
      status = runs_lib.train(protocol.resolve(config, finished), out, arm, seed,
                              args.python)
      if status == 0:
        break
      if status in (cli.EXIT_PREEMPTED, cli.EXIT_INTERRUPTED):  # checkpointed
        print(f"[study] {arm} seed {seed} stopped (exit {status}); run the same command "
              "again to resume", file=sys.stderr, flush=True)
        return cli.EXIT_PREEMPTED
    else:
      return cli.error(f"{arm} seed {seed} failed {config.retries + 1} times (exit "
                       f"{status}); see {wd}/train.log")
    runs_lib.write_summary(protocol.resolve(config, finished), out, summaries, arm, seed)
    shutil.rmtree(os.path.join(wd, "checkpoints"), ignore_errors=True)


def status(config, args) -> int:
  summaries = protocol.read_summaries(os.path.join(args.out, "summaries"))
  todo, state = protocol.plan(config, summaries, args.exploratory)
  done = [f"{arm}_s{seed}" for arm, seed in sorted(summaries)]
  print(f"finished ({len(done)}): {' '.join(done) or '-'}")
  print(f"{state}; next: {' '.join(f'{a}_s{s}' for a, s in todo) or '-'}")
  return 0


def report(config, args) -> int:
  from exgrpo_jax.study import report as report_lib  # pylint: disable=g-import-not-at-top
  directory = args.summaries or os.path.join(args.out, "summaries")
  path = args.json or os.path.join(args.out, f"{config.name}.json")
  if not os.path.isdir(directory):
    raise cli.UsageError(f"--summaries {directory}: no such directory")
  _check_writable("--out", args.out, directory=True)
  _check_writable("--json", path, directory=False)
  summaries = protocol.read_summaries(directory)
  if not summaries:
    raise cli.UsageError(f"--summaries {directory}: no finished runs (<arm>_s<seed>.json)")
  problem = protocol.unpaired(config, summaries)
  if problem:
    raise cli.UsageError(f"--summaries {directory}: {problem}; nothing to report")
  if importlib.util.find_spec("scipy") is None:
    return cli.error("the report's tests need scipy: pip install scipy (the `test` extra)")
  result = report_lib.report(protocol.resolve(config, summaries), summaries)
  public = {k: v for k, v in result.items() if not k.startswith("_")}
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(public, f, indent=1)
  print(json.dumps({k: public[k] for k in ("primary", "attribution", "arms", "rules")},
                   indent=1))
  print(f"wrote {path}", file=sys.stderr)
  for figure in report_lib.plot(config, result, args.out):
    print(f"wrote {figure}", file=sys.stderr)
  return 0


def main(argv=None) -> int:
  args = _parser().parse_args(argv)

  def go():
    config = protocol.load(args.config, args.smoke)
    return {"run": run, "status": status, "report": report}[args.command](config, args)
  return cli.guarded(go, debug=args.debug, prefix=PROG)


if __name__ == "__main__":
  sys.exit(main())
