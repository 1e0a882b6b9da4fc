r"""Chooses a paper config's mesh, micro-batch, rollout slots and KV pool for a target
from the compiler's figures, and writes the report of the chosen settings (JSON).

  .aot/gpu/bin/python scripts/aot_plan.py --config=configs/qwen7b.py --target=h100x8 \
      --out=docs/results/aot_qwen7b_h100x8.json
  .aot/tpu/bin/python scripts/aot_plan.py --config=configs/llama8b.py --target=v6e-8 \
      --like docs/results/aot_llama8b_v6e-8.json --meshes 4,8 --out=...  # no new search
  python scripts/aot_plan.py --render docs/results/aot_*.json     # docs/aot.md's table
  python scripts/aot_plan.py --render docs/results/aot_qwen7b_*.json --estimate \
      [--lengths RECORD.json | --mean 3501 --cap-share 0.09]      # at real lengths

For each mesh fsdp x tensor over the target's devices (tensor 1, 2, 4, and 8 where the
query heads divide), all layers compiled (`exgrpo_jax.aot`):
  learner   the config's micro-batch, halved until the learner's programs fit;
  rollout   the most rows per call (`rollout.max_rows` up to the step's B x K rows, a
            multiple of the rows' unit: K and the mesh's batch shards) whose programs fit:
            each program's per-device peak (with what stays beside it) is affine in the
            slots, so two compiles (64 and 256 slots) predict the largest multiple of 64,
            which is then compiled, stepped down by 64 until it fits, and shown to be the
            largest by the next 64 not fitting; the peaks of those two predict the
            largest multiple of the unit between them, compiled and shown the same way.
Each fitting mesh's whole training step is then compiled with those settings
(`reserved_rows`: every slot's row reserved at its longest), and admission planned
(`Planner.admission`): the pool's capacity (`rollout.kv_pages`) is what the memory holds
beside that step's decode, the slots (`rollout.max_rows`) those that cost least at the
mid length scenario over it (`exgrpo_jax.aot.lengths`), compiled, the capacity lowered
until every program fits; unless the reserved rows cost least. The chosen mesh is the one
whose step costs least with its rollout at the mid lengths (`settled`: each mesh's
settings and estimate); its last compile's report is the output, with every compile's
figures under "search". GPU targets read
XLA_PYTHON_CLIENT_MEM_FRACTION (docs/aot.md runs them at 0.95). `--like` takes another
config's choice (the instruct models have their base model's shapes), its admission
too, and compiles it; a plan as its own `--like` redoes its admission without the search.
"""

import argparse
import glob
import importlib
import json
import math
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from exgrpo_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import config_cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax.aot import targets  # pylint: disable=g-import-not-at-top,wrong-import-position

GIB = 2 ** 30
STEP = 64
ADMISSION_TRIES = 4  # compiles of the capacity, each lowered by what the last lacked


def _config(name: str, tensor: int, devices: int, micro: int, max_rows: int,
            kv_pages: int = 0):
  config = importlib.import_module(f"configs.{name}").get_config()
  with config.unlocked():
    config.mesh.shape = (devices // tensor, tensor)
    config.optim.micro_batch_size = micro
    config.rollout.max_rows = max_rows
    config.rollout.kv_pages = kv_pages
  return config


def _peaks(report: dict) -> dict:
  """Each program's device peak (GiB), or None where it failed to compile."""
  return {p["name"]: (None if p["error"] else p["device_peak_bytes"] / GIB)
          for p in report["programs"]}


def _need(failure: str) -> float:
  """The GiB per device a failed compile asked for (inf where its error does not say)."""
  need = re.search(r"([\d.]+) GiB (?:needed|per device)", failure)
  return float(need[1]) if need else math.inf


class Planner:
  """Runs the compiles of one config on one target and keeps what each one said."""

  def __init__(self, name: str, target: str):
    from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
    self.check, self.name, self.target = check, name, target
    self.spec = targets.get(target)
    self.usable = targets.usable_bytes(self.spec) / GIB
    self.search = []

  def compile(self, tensor, micro, max_rows, parts, kv_pages=0) -> dict:
    config = _config(self.name, tensor, self.spec.devices, micro, max_rows, kv_pages)
    print(f"[plan] {self.name} {self.target} tensor={tensor} micro={micro} "
          f"max_rows={max_rows} kv_pages={kv_pages} {'+'.join(parts)}", file=sys.stderr,
          flush=True)
    report = self.check.run(config, self.target, parts=parts, progress=lambda _: None)
    self.search.append(dict(tensor=tensor, micro_batch_size=micro, max_rows=max_rows,
                            kv_pages=kv_pages, parts=list(parts), ok=report["ok"],
                            first_failure=report["first_failure"],
                            device_peak_gib=_peaks(report)))
    return report

  def learner(self, tensor: int, micro: int) -> int:
    """The largest micro-batch (halving from `micro`) whose learner programs fit; 0: none."""
    while micro >= 1:
      if self.compile(tensor, micro, STEP, ("learner",))["ok"]:
        return micro
      micro //= 2
    return 0

  def rollout(self, tensor: int, rows: int, unit: int) -> int:
    """The most rows per call (a multiple of `unit`, at most `rows`) that fit; 0: none."""
    seen = {}

    def peaks(n):
      if n not in seen:
        report = self.compile(tensor, 1, n, ("rollout",))
        seen[n] = report["ok"], _peaks(report)
      return seen[n]

    fits = lambda n: peaks(n)[0]
    guess = _largest(peaks(STEP)[1], peaks(4 * STEP)[1], STEP, 4 * STEP, self.usable, rows,
                     STEP)
    if guess is None:
      return 0
    while guess > STEP and not fits(guess):
      guess -= STEP
    if guess == STEP and not fits(STEP):
      return 0
    while guess + STEP <= rows and fits(guess + STEP):  # the estimate was low
      guess += STEP
    top = min(guess + STEP, rows)
    if top == guess or fits(top):
      return top
    # The largest multiple of `unit` below `top` (which does not fit), from the two peaks.
    fine = _largest(peaks(guess)[1], peaks(top)[1], guess, top, self.usable, top - unit,
                    unit)
    fine = max(guess, fine)
    while fine > guess and not fits(fine):
      fine -= unit
    while fine + unit < top and fits(fine + unit):
      fine += unit
    return fine


  def admission(self, best: dict, reserved: dict, headroom: float):
    """The pool's capacity and the slots over it, from `reserved` (the step compiled at
    `best`'s rows, each with a pool row at its longest): the pages the memory holds
    (`pool_bound`), the slots that cost least at the mid scenario over them and no more
    than the reserved rows at the others (`lengths.best_slots`), compiled, and the pages
    lowered by what the costliest program lacked until it fits. Returns (report, slots,
    pages), or None where the reserved rows cost least or nothing fits."""
    from exgrpo_jax.aot import lengths  # pylint: disable=g-import-not-at-top
    b = reserved["batch"]
    shards, page_bytes = lengths.kv_layout(reserved)
    per_row = lengths.row_pages(reserved)
    pages = int(pool_bound(reserved) * per_row) // shards * shards
    dists = lengths.distributions(b["response_tokens"], b["questions"] * b["k"])
    mid = dists.pop("mid")
    today = lengths.rollout_estimate(reserved, mid)
    for _ in range(ADMISSION_TRIES):
      chosen = lengths.best_slots(reserved, mid, headroom, today, capacity=pages,
                                  also=dists.values())
      if chosen is today or pages < per_row * shards:
        return None
      report = self.compile(best["tensor"], best["micro_batch_size"], chosen["slots"],
                            ("learner", "rollout"), kv_pages=pages)
      if report["ok"]:
        return report, chosen["slots"], pages
      over = max((p["device_peak_bytes"] - p["usable_bytes"] if not p["error"]
                  else (_need(p["error"]) - self.usable) * GIB)
                 for p in report["programs"])
      per_shard = pages // shards
      lower = math.ceil(max(over, 0) / page_bytes) + 1 if math.isfinite(over) else per_shard // 10
      pages -= lower * shards
    return None


def _largest(low: dict, high: dict, at_low: int, at_high: int, usable: float, most: int,
             unit: int) -> int | None:
  """The most rows (a multiple of `unit`, at least `unit`, at most `most`) whose peaks fit
  `usable`, with each program's peak affine in the rows through its peaks `low` at
  `at_low` rows and `high` at `at_high`; None where a program failed at `at_low`."""
  if any(v is None for v in low.values()):
    return None
  guess = most
  for name, peak in low.items():
    slope = ((high.get(name) or peak) - peak) / (at_high - at_low)
    if slope > 0:
      guess = min(guess, at_low + int((usable - peak) / slope))
  return max(unit, min(most, guess) // unit * unit)


def plan(name: str, target: str, like: dict | None = None,
         meshes: tuple[int, ...] = ()) -> dict:
  """The search and the chosen settings' report; `like` (another config's plan on the
  same target, with the same shapes) skips the search and takes its choice, or its
  candidates of tensor sizes `meshes` (the mesh is then chosen among them)."""
  planner = Planner(name, target)
  base = importlib.import_module(f"configs.{name}").get_config()
  rows = base.train.batch_questions * base.rollout.k
  heads = planner.check.model_config(base).num_heads
  candidates = []
  for tensor in (1, 2, 4, 8):
    if like or planner.spec.devices % tensor or (tensor == 8 and heads % 8):
      continue
    micro = planner.learner(tensor, base.optim.micro_batch_size)
    unit = math.lcm(base.rollout.k, planner.spec.devices // tensor)
    max_rows = planner.rollout(tensor, rows, unit) if micro else 0
    candidates.append(dict(tensor=tensor, micro_batch_size=micro, max_rows=max_rows))
  fitting = [c for c in candidates if c["micro_batch_size"] and c["max_rows"]]
  result = dict(config=f"configs/{name}.py", target=target, usable_gib=planner.usable,
                candidates=candidates, search=planner.search,
                searched_as=like["config"] if like else None)
  if like and meshes:
    fitting = [dict(tensor=c["tensor"], micro_batch_size=c["micro_batch_size"],
                    max_rows=c["max_rows"]) for c in like["candidates"]
               if c["tensor"] in meshes and c["micro_batch_size"] and c["max_rows"]]
  elif like and like["fits"]:
    fitting = [dict(tensor=like["chosen"]["tensor"],
                    micro_batch_size=like["chosen"]["micro_batch_size"],
                    max_rows=like["chosen"].get("reserved_rows", like["chosen"]["max_rows"]))]
  if not fitting:
    if like:
      return dict(result, fits=False, verdict=f"{name}, as {like['config']}: {like['verdict']}")
    least = min((s for s in planner.search if s["first_failure"]),
                key=lambda s: _need(s["first_failure"]))
    return dict(result, fits=False, verdict=(
        f"{name} does not fit {target} at any mesh or micro-batch; the least: mesh "
        f"{planner.spec.devices // least['tensor']} x {least['tensor']}, micro-batch "
        f"{least['micro_batch_size']}: {least['first_failure']}"))
  # Another config's admission is taken as it is; a plan's own is planned again.
  other = like and like["fits"] and not meshes and like["config"] != result["config"]
  chosen = like["chosen"] if other else {}
  settled = [_settle(planner, c, base, chosen) for c in fitting]
  mid_s = [_mid_step_s(report, base.rollout.kv_headroom) for report, _ in settled]
  final, best = settled[mid_s.index(min(mid_s))]
  flags = (f"--config.mesh.shape='({planner.spec.devices // best['tensor']}, "
           f"{best['tensor']})' --config.rollout.max_rows={best['max_rows']}")
  if best["kv_pages"]:
    flags += f" --config.rollout.kv_pages={best['kv_pages']}"
  if best["micro_batch_size"] != base.optim.micro_batch_size:
    flags += f" --config.optim.micro_batch_size={best['micro_batch_size']}"
  return dict(result, fits=final["ok"], chosen=dict(best, flags=flags), report=final,
              verdict=final["first_failure"] or f"fits: {flags}",
              settled=[dict(s, mid_step_s=m) for (_, s), m in zip(settled, mid_s)])


def _settle(planner, candidate: dict, base, chosen: dict) -> tuple[dict, dict]:
  """A mesh's whole step compiled at its reserved rows, then with admission
  (`Planner.admission`), or at `chosen`'s slots and pages (a `--like` plan's):
  (its report, its settings with `reserved_rows` and `kv_pages`, 0 without admission)."""
  best = dict(candidate, reserved_rows=candidate["max_rows"], kv_pages=0)
  if chosen.get("kv_pages"):  # the other config's admission, compiled as it is
    final = planner.compile(best["tensor"], best["micro_batch_size"], chosen["max_rows"],
                            ("learner", "rollout"), kv_pages=chosen["kv_pages"])
    admitted = final, chosen["max_rows"], chosen["kv_pages"]
  else:
    final = planner.compile(best["tensor"], best["micro_batch_size"], best["max_rows"],
                            ("learner", "rollout"))
    admitted = final["ok"] and planner.admission(best, final, base.rollout.kv_headroom)
  if admitted:
    final, slots, pages = admitted
    best.update(max_rows=slots, kv_pages=pages)
  return final, best


def _mid_step_s(report: dict, headroom: float) -> float:
  """A compiled step's roofline seconds with its rollout at the mid length scenario
  (`lengths.rollout_estimate` at its slots and pages; inf where it does not fit)."""
  from exgrpo_jax.aot import lengths  # pylint: disable=g-import-not-at-top
  if not report["ok"]:
    return math.inf
  b, est = report["batch"], report["step_estimate"]
  mid = lengths.scenario("mid", b["response_tokens"], b["questions"] * b["k"])
  return (lengths.rollout_estimate(report, mid, headroom=headroom)["rollout_s"]
          + est["old_logp_recompute_s"] + est["learner_s"])


def pool_bound(report: dict) -> float:
  """Rows per call the pool leaves room for (an estimate from the compiler's figures): the
  usable memory less decode_chunk's device peak without its pool (what stays resident,
  the rollout's weights, the decode's temporaries), over a full-length row's KV bytes
  per device (`lengths.kv_layout`: whole pages, rows split by the batch axes)."""
  from exgrpo_jax.aot import lengths  # pylint: disable=g-import-not-at-top
  b = report["batch"]
  shards, page_bytes = lengths.kv_layout(report)
  per_row = lengths.row_pages(report)
  row_bytes = per_row * page_bytes / shards
  decode = next(p for p in report["programs"] if p["name"] == "decode_chunk")
  pool_pages = b.get("kv_pages") or b["max_rows"] * per_row  # as compiled
  fixed = decode["device_peak_bytes"] - pool_pages / shards * page_bytes
  return (decode["usable_bytes"] - fixed) / row_bytes


def decode_step_bytes(report: dict) -> float:
  """What one decode step reads from HBM per device in the roofline (`decode_chunk`'s
  bytes per call less those once per call, `analysis.call_bytes`, over its steps): the
  weights and the pool's pages the step attends to (every page before the kernel, its
  live pages with it)."""
  from exgrpo_jax.aot import analysis  # pylint: disable=g-import-not-at-top
  decode = next(p for p in report["programs"] if p["name"] == "decode_chunk")
  steps = int(re.match(r"(\d+) decode steps", decode["purpose"])[1])
  return (decode["hbm_bytes_per_call"] - analysis.call_bytes(decode)) / steps


def prefill_seconds(report: dict) -> float:
  """The roofline seconds per step of the prompts' prefill (`admit`) and its copy into
  the pool's pages (`place`): the most that prefilling through the paged-attention
  kernel, straight into pages, could save."""
  return sum(p["roofline_s"] * p["calls_per_step"] for p in report["programs"]
             if p["name"] in ("admit", "place"))


def render(paths) -> str:
  """docs/aot.md's tables: per config and target, the chosen settings, the pool's bound on
  the rows (`pool_bound`) and the compiler's per-device peaks (GiB) of the learner step
  and the largest rollout program, with the
  verdict of each that does not fit below; then the roofline estimate of one training
  step with them, the HBM bytes of one decode step (`decode_step_bytes`) and the
  prefill's part of the rollout (`prefill_seconds`)."""
  lines = ["| config | target | mesh fsdp x tensor | micro-batch | max_rows | kv_pages "
           "| pool bound | learner peak | rollout peak (program) | usable |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  estimates = ["| config | target | rows per call | decode GiB per step | rollout s "
               "| of it prefill s | old-log-prob recompute s | learner s | step s |",
               "|---|---|---|---|---|---|---|---|---|"]
  verdicts = []
  plans = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      p = json.load(f)
    if "config" in p:  # not a plan (aot_accelerator_learner.json)
      plans.append((p["config"].removeprefix("configs/").removesuffix(".py"), p))
  for name, p in sorted(plans, key=lambda t: (t[0], t[1]["target"])):
    if not p["fits"] or "report" not in p:
      lines.append(f"| {name} | {p['target']} | does not fit (below) | | | | | | "
                   f"| {p['usable_gib']:.2f} |")
      verdicts.append(f"- {p['verdict']}")
      continue
    programs = {q["name"]: q for q in p["report"]["programs"]}
    rollout = max((q for q in programs.values() if q["name"] not in ("learner_step", "score")),
                  key=lambda q: q["device_peak_bytes"])
    c, est = p["chosen"], p["report"]["step_estimate"]
    lines.append(
        f"| {name} | {p['target']} | {p['report']['mesh'].get('fsdp', 1)} x "
        f"{p['report']['mesh'].get('tensor', 1)} | {c['micro_batch_size']} | {c['max_rows']} "
        f"| {c.get('kv_pages') or 'all rows'} | {pool_bound(p['report']):.0f} "
        f"| {programs['learner_step']['device_peak_bytes'] / GIB:.2f} "
        f"| {rollout['device_peak_bytes'] / GIB:.2f} ({rollout['name']}) "
        f"| {p['usable_gib']:.2f} |")
    estimates.append(f"| {name} | {p['target']} | {c['max_rows']} "
                     f"| {decode_step_bytes(p['report']) / GIB:.2f} | {est['rollout_s']:.0f} "
                     f"| {prefill_seconds(p['report']):.1f} "
                     f"| {est['old_logp_recompute_s']:.0f} | {est['learner_s']:.0f} "
                     f"| {est['total_s']:.0f} |")
  return "\n".join(lines + ([""] + verdicts if verdicts else []) + [""] + estimates)


def _plan_files(parser, patterns: list[str]) -> list[str]:
  """The files `--render` names; a pattern matching nothing is a bad argument."""
  paths = []
  for pattern in patterns:
    found = sorted(glob.glob(pattern))
    if not found:
      parser.error(f"--render {pattern}: no such file")
    paths += found
  return paths


def _read_plan(parser, flag: str, path: str) -> dict:
  """A plan JSON file, or one line naming what is wrong with it (exit status 2)."""
  try:
    with open(path, encoding="utf-8") as f:
      plan_ = json.load(f)
  except OSError as e:
    parser.error(f"{flag} {path}: {e.strerror}")
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    parser.error(f"{flag} {path}: not a JSON file ({e})")
  if not isinstance(plan_, dict):
    parser.error(f"{flag} {path}: not a plan (a JSON object written by this script)")
  return plan_


def _estimates(parser, args, plans: dict) -> str:
  """`lengths.table` of the fitting plans, or one line naming the bad length argument."""
  from exgrpo_jax.aot import lengths  # pylint: disable=g-import-not-at-top
  if args.mean is not None and not (args.mean > 0 and 0 <= args.cap_share < 1):
    parser.error(f"--mean {args.mean:g} --cap-share {args.cap_share:g}: give a mean above "
                 "0 and a share at the cap in [0, 1)")
  named = sorted(((p["config"].removeprefix("configs/").removesuffix(".py"), p)
                  for p in plans.values() if p.get("fits") and "report" in p),
                 key=lambda t: (t[0], t[1]["target"]))
  try:
    return lengths.table(named, path=args.lengths, mean=args.mean, cap_share=args.cap_share)
  except OSError as e:
    parser.error(f"--lengths {args.lengths}: {e.strerror}")
  except ValueError as e:
    parser.error(str(e))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="aot_plan.py", description=__doc__.split("\n")[0])
  parser.add_argument("--config", help="configs/NAME.py")
  parser.add_argument("--target", choices=list(targets.TARGETS))
  parser.add_argument("--out")
  parser.add_argument("--like", help="a plan JSON of a config with the same shapes on the "
                      "same target: compile its choice instead of searching")
  parser.add_argument("--meshes", default="", help="with --like: settle these of its "
                      "candidates (tensor sizes, e.g. 4,8) and choose among them")
  parser.add_argument("--render", nargs="+", help="render these plan JSON files")
  parser.add_argument("--estimate", action="store_true", help="with --render: the "
                      "rollout's seconds at real lengths too (exgrpo_jax.aot.lengths): the "
                      "three scenarios, or --lengths / --mean, and all rows at the cap")
  parser.add_argument("--lengths", help="scripts/record_rollout_lengths.py's JSON")
  parser.add_argument("--mean", type=float, help="a mean response length (tokens)")
  parser.add_argument("--cap-share", type=float, default=0.0,
                      help="with --mean: the share of responses at the cap")
  args = parser.parse_args(argv)
  if args.render:
    paths = _plan_files(parser, args.render)
    plans = {path: _read_plan(parser, "--render", path) for path in paths}
    if not any("config" in p for p in plans.values()):
      parser.error(f"--render: none of {', '.join(paths)} is a plan (no 'config' key)")
    print(render(paths))
    if args.estimate:
      print("\n" + _estimates(parser, args, plans))
    return
  if not (args.config and args.target and args.out):
    parser.error("give --config, --target and --out (or --render FILES)")
  # The planner imports configs.NAME: the file must be one of the repository's configs.
  name = os.path.basename(args.config).removesuffix(".py")
  if not os.path.isfile(os.path.join(REPO, "configs", f"{name}.py")):
    parser.error(f"--config={args.config}: no such config in {os.path.join(REPO, 'configs')}")
  problem = config_cli.config_problem([f"--config={os.path.join(REPO, 'configs', name)}.py"])
  if problem:
    parser.error(problem)
  like = _read_plan(parser, "--like", args.like) if args.like else None
  try:
    meshes = tuple(int(t) for t in args.meshes.split(",")) if args.meshes else ()
  except ValueError:
    parser.error(f"--meshes {args.meshes}: give tensor sizes, e.g. 4,8")
  if meshes and not (like and {c["tensor"] for c in like.get("candidates", [])} >= set(meshes)):
    parser.error(f"--meshes {args.meshes}: needs --like a searched plan with those candidates")
  try:
    cli.check_writable(args.out)  # before minutes of compiles, not after them
  except OSError as e:
    parser.error(str(e))
  targets.prepare_environment()
  result = plan(name, args.target, like, meshes)
  from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
  check.save(result, args.out)
  print(result["verdict"])


if __name__ == "__main__":
  main()
