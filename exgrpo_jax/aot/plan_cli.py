r"""`python -m exgrpo_jax.aot plan`: does a config fit a target, and how long is its step.

  .aot/gpu/bin/python -m exgrpo_jax.aot plan --config=configs/qwen7b.py --target=h100x8 \
      --out=docs/results/aot_qwen7b_h100x8.json            # the search (`plan.plan`)
  .aot/tpu/bin/python -m exgrpo_jax.aot plan --config=configs/llama8b.py --target=v6e-8 \
      --like docs/results/aot_llama8b_v6e-8.json --meshes 4,8 --out=...  # no new search
  .aot/tpu/bin/python -m exgrpo_jax.aot plan --config=configs/qwen7b.py --target=v5p-8 \
      --like docs/results/aot_qwen7b_v5p-8.json --slots 1024 --out=...   # a recommendation
  python -m exgrpo_jax.aot plan --render docs/results/aot_*.json   # docs/aot.md's tables
  python -m exgrpo_jax.aot plan --render docs/results/aot_qwen7b_*.json --estimate \
      [--lengths RECORD.json | --mean 3501 --cap-share 0.09]     # at real lengths

A search writes its plan to --out and prints its verdict: exit 0 where a setting fits, 1
where none does (the verdict names the least failing compile), 2 on a bad argument (one
line, before any compile). `--render` prints the plans' tables: per config and target
the chosen settings, the pool's bound on the rows (`plan.pool_bound`) and the
compiler's per-device peaks, then the roofline estimate of one training step;
`--estimate` adds the rollout at real lengths (`exgrpo_jax.aot.lengths`).
"""

import argparse
import glob
import json
import re
import sys

from exgrpo_jax import cli
from exgrpo_jax import config_cli
from exgrpo_jax.aot import plan as plan_lib
from exgrpo_jax.aot import targets
from exgrpo_jax.sampling import pages

GIB = plan_lib.GIB
PROG = "exgrpo_jax.aot plan"
HEADROOM = pages.KV_HEADROOM  # the configs' rollout.kv_headroom


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
  """docs/aot.md's tables: per config and target, the chosen settings, the rows the
  chosen pool holds at their longest (`pool rows`), the most the memory would hold beside
  the decode (`memory's bound`, `plan.pool_bound`), the compiler's per-device peaks (GiB)
  of the learner step and the largest rollout program, the usable memory and the margin
  kept below it, with the verdict of each that does not fit below; then the roofline
  estimate of one training step with them (every response at the cap, and the plan's
  mid step, `plan.mid_step_s`), the HBM bytes of one decode step (`decode_step_bytes`)
  and the prefill's part of the rollout (`prefill_seconds`)."""
  from exgrpo_jax.aot import lengths  # pylint: disable=g-import-not-at-top
  lines = ["| config | target | mesh fsdp x tensor | micro-batch | max_rows | kv_pages "
           "| pool rows | memory's bound | learner peak | rollout peak (program) | usable "
           "| margin |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  estimates = ["| config | target | rows per call | decode GiB per step | rollout s "
               "| of it prefill s | old-log-prob recompute s | learner s | step s "
               "| mid step s |", "|---|---|---|---|---|---|---|---|---|---|"]
  verdicts = []
  plans = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      p = json.load(f)
    if plan_lib.is_plan(p):  # others are skipped (aot_accelerator_learner.json)
      plans.append((plan_lib.config_name(p["config"]), p))
  for name, p in sorted(plans, key=lambda t: (t[0], t[1]["target"])):
    margin = f"{plan_lib.margin_gib(p):.2f}"
    if not p["fits"] or "report" not in p:
      lines.append(f"| {name} | {p['target']} | does not fit (below) | | | | | | | "
                   f"| {p['usable_gib']:.2f} | {margin} |")
      verdicts.append(f"- {p['verdict']}")
      continue
    programs = {q["name"]: q for q in p["report"]["programs"]}
    rollout = max((q for q in programs.values() if q["name"] not in ("learner_step", "score")),
                  key=lambda q: q["device_peak_bytes"])
    c, est = p["chosen"], p["report"]["step_estimate"]
    paged = "decode_chunk" in programs  # else the static loop: no pool, no decode chunk
    pool = (f"| {c.get('kv_pages') or 'all rows'} "
            f"| {lengths.capacity_pages(p) // lengths.row_pages(p['report'])} "
            f"| {plan_lib.pool_bound(p['report']):.0f} " if paged else "| - | - | - ")
    lines.append(
        f"| {name} | {p['target']} | {p['report']['mesh'].get('fsdp', 1)} x "
        f"{p['report']['mesh'].get('tensor', 1)} | {c['micro_batch_size']} | {c['max_rows']} "
        + pool +
        f"| {programs['learner_step']['device_peak_bytes'] / GIB:.2f} "
        f"| {rollout['device_peak_bytes'] / GIB:.2f} ({rollout['name']}) "
        f"| {p['usable_gib']:.2f} | {margin} |")
    decode_gib = f"{decode_step_bytes(p['report']) / GIB:.2f}" if paged else "-"
    estimates.append(f"| {name} | {p['target']} | {c['max_rows']} "
                     f"| {decode_gib} | {est['rollout_s']:.0f} "
                     f"| {prefill_seconds(p['report']):.1f} "
                     f"| {est['old_logp_recompute_s']:.0f} | {est['learner_s']:.0f} "
                     f"| {est['total_s']:.0f} | {plan_lib.mid_step_s(p, HEADROOM):.0f} |")
  return "\n".join(lines + ([""] + verdicts if verdicts else []) + [""] + estimates)


def _plan_files(parser, patterns: list[str], flag: str = "--render") -> list[str]:
  """The files `flag` names; a pattern matching nothing is a bad argument."""
  paths = []
  for pattern in patterns:
    found = sorted(glob.glob(pattern))
    if not found:
      parser.error(f"{flag} {pattern}: no such file")
    paths += found
  return paths


def _read_plan(parser, flag: str, path: str) -> dict:
  """A plan JSON file, or one line naming what is wrong with it (exit status 2)."""
  try:
    plan_ = cli.read_json(flag, path)
  except cli.UsageError as e:
    parser.error(str(e))
  if not isinstance(plan_, dict):
    parser.error(f"{flag} {path}: not a plan (a JSON object written by this script)")
  return plan_


def _check_like(parser, args, like: dict) -> None:
  """`--like` takes a plan that fits (with --meshes, one with candidates), of this
  target unless --like-any; it never hands on a verdict it did not compile."""
  if not plan_lib.is_plan(like):
    parser.error(f"--like {args.like}: not a plan (written by `{PROG} --out`)")
  if like["target"] != args.target and not args.like_any:
    parser.error(f"--like {args.like}: a plan for {like['target']}, not {args.target} "
                 "(--like-any takes its settings anyway)")
  if not like["fits"] and not args.meshes:
    parser.error(f"--like {args.like}: {plan_lib.config_name(like['config'])} fits nothing "
                 f"on {like['target']}, so it has no settings to compile; search without "
                 "--like")


def _check_shapes(args, like: dict) -> None:
  """A plan of a model of other shapes is refused unless --like-any (after the
  compilers' environment is set: reading the model's shapes imports JAX)."""
  from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
  if "report" not in like:
    return
  cfg = check.model_config(config_cli.load(args.config))
  mine = dict(layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads,
              kv_heads=cfg.num_kv_heads, vocab=cfg.vocab_size)
  theirs = {k: like["report"]["model"][k] for k in mine}
  if mine != theirs:
    differ = ", ".join(f"{k} {theirs[k]} (here {mine[k]})" for k in mine
                       if mine[k] != theirs[k])
    raise cli.UsageError(f"--like {args.like}: a plan of a model of other shapes: {differ} "
                         "(--like-any takes its settings anyway)")


def _estimates(parser, args, plans: dict) -> str:
  """`lengths.table` of the fitting plans, or one line naming the bad length argument."""
  from exgrpo_jax.aot import lengths  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import step_lengths  # pylint: disable=g-import-not-at-top
  if args.mean is not None and not (args.mean > 0 and 0 <= args.cap_share < 1):
    parser.error(f"--mean {args.mean:g} --cap-share {args.cap_share:g}: give a mean above "
                 "0 and a share at the cap in [0, 1)")
  named = sorted(((plan_lib.config_name(p["config"]), p)
                  for p in plans.values() if p.get("fits") and "report" in p),
                 key=lambda t: (t[0], t[1]["target"]))
  given = dict(path=args.lengths, mean=args.mean, cap_share=args.cap_share)
  try:
    return (lengths.table(named, **given) + "\n\nOne training step (roofline seconds; the "
            "rollout with admission, the recompute and the learner packed at the same "
            "lengths):\n\n" + step_lengths.step_table(named, **given))
  except OSError as e:
    parser.error(f"--lengths {args.lengths}: {e.strerror}")
  except ValueError as e:
    parser.error(f"--lengths {e}" if args.lengths else str(e))


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
  parser.add_argument("--config", help="a config file, FILE.py[:ARG] (search)")
  parser.add_argument("--target", choices=[*targets.TARGETS, targets.CPU],
                      help="search (cpu: this host, with its measured rates)")
  parser.add_argument("--out", help="search: write the plan here (JSON)")
  parser.add_argument("--like", help="search: a fitting plan JSON of a config with the "
                      "same model shapes on the same target (this config's own included): "
                      "compile its choice for this config instead of searching")
  parser.add_argument("--like-any", action="store_true", help="with --like: take a plan "
                      "of another target or of a model of other shapes too")
  parser.add_argument("--meshes", help="with --like: settle these of its candidates "
                      "(tensor sizes, e.g. 4,8) and choose among them")
  parser.add_argument("--slots", type=cli.positive_int, help="with --like: compile its "
                      "choice with this many rollout slots over its pool (a slot count "
                      "--estimate recommends)")
  parser.add_argument("--render", nargs="+", help="render these plan JSON files")
  parser.add_argument("--reprice", nargs="+", help="count these plans' FLOPs again from a "
                      "fresh trace (no compile) and write their rooflines and step "
                      "estimates back in place (exgrpo_jax.aot.reprice); in the target's "
                      "environment (.aot/tpu or .aot/gpu)")
  parser.add_argument("--estimate", action="store_true", help="with --render: the "
                      "rollout's seconds at real lengths too (exgrpo_jax.aot.lengths): the "
                      "three scenarios, or --lengths / --mean, and all rows at the cap")
  parser.add_argument("--lengths", help="with --estimate: "
                      "scripts/bench/record_rollout_lengths.py's JSON")
  parser.add_argument("--mean", type=float,
                      help="with --estimate: a mean response length (tokens)")
  parser.add_argument("--cap-share", type=float,
                      help="with --mean: the share of responses at the cap")
  cli.add_debug_flag(parser)
  return parser


def _refuse_ignored(parser, args) -> None:
  """Flags that the chosen mode would not read are refused, not ignored."""
  given = lambda *names: [f"--{n.replace('_', '-')}" for n in names
                          if getattr(args, n) not in (None, False)]
  if args.render and args.reprice:
    parser.error("--render and --reprice: give one")
  if args.render or args.reprice:
    mode = "--render only renders" if args.render else "--reprice only reprices"
    extra = given("config", "target", "out", "like", "like_any", "meshes", "slots")
    if extra:
      parser.error(f"{extra[0]} searches; {mode} plans: give one or the other")
  else:
    extra = given("estimate", "lengths", "mean", "cap_share")
    if extra:
      parser.error(f"{extra[0]} is read only with --render FILES")
  if not args.estimate:
    extra = given("lengths", "mean", "cap_share")
    if extra:
      parser.error(f"{extra[0]} is read only with --estimate")
  if args.like_any and not args.like:
    parser.error("--like-any is read only with --like PLAN")
  if args.cap_share is not None and args.mean is None:
    parser.error("--cap-share is read only with --mean")
  if args.lengths and args.mean is not None:
    parser.error("--lengths and --mean are two length distributions: give one")


def _reprice(parser, args) -> int:
  """Each plan of --reprice counted again and priced (`reprice.reprice`), written back."""
  paths = _plan_files(parser, args.reprice, "--reprice")
  plans = {path: _read_plan(parser, "--reprice", path) for path in paths}
  for path, p in plans.items():
    if not plan_lib.is_plan(p):
      parser.error(f"--reprice {path}: not a plan (written by `{PROG} --out`)")
  targets.prepare_environment()

  def go() -> int:
    from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
    from exgrpo_jax.aot import reprice  # pylint: disable=g-import-not-at-top
    for path, p in plans.items():
      new = reprice.reprice(p)
      check.save(new, path)
      before = (p.get("report") or {}).get("step_estimate") or {}
      after = (new.get("report") or {}).get("step_estimate") or {}
      print(f"{path}: step {before.get('total_s', 0):.0f} s -> {after.get('total_s', 0):.0f} s "
            "(every response at the cap, roofline)", flush=True)
    return 0
  return cli.guarded(go, debug=args.debug, prefix=PROG)


def main(argv=None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  _refuse_ignored(parser, args)
  if args.cap_share is None:
    args.cap_share = 0.0
  if args.render:
    paths = _plan_files(parser, args.render)
    plans = {path: _read_plan(parser, "--render", path) for path in paths}
    if not any(plan_lib.is_plan(p) for p in plans.values()):
      parser.error(f"--render: none of {', '.join(paths)} is a plan (written by "
                   f"`{PROG} --out`)")
    print(render(paths))
    if args.estimate:
      print("\n" + _estimates(parser, args, plans))
    return 0
  if args.reprice:
    return _reprice(parser, args)
  if not (args.config and args.target and args.out):
    parser.error("give --config, --target and --out (or --render FILES)")
  problem = config_cli.config_problem([f"--config={args.config}"])
  if problem:
    parser.error(problem)
  like = _read_plan(parser, "--like", args.like) if args.like else None
  if like is not None:
    _check_like(parser, args, like)
  try:
    meshes = tuple(int(t) for t in args.meshes.split(",")) if args.meshes else ()
  except ValueError:
    parser.error(f"--meshes {args.meshes}: give tensor sizes, e.g. 4,8")
  if meshes and not (like and {c["tensor"] for c in like.get("candidates", [])} >= set(meshes)):
    parser.error(f"--meshes {args.meshes}: needs --like a searched plan with those candidates")
  if args.slots and not (like and like.get("fits") and "report" in like) or (
      args.slots and meshes):
    parser.error(f"--slots {args.slots}: needs --like a plan that fits (and no --meshes)")
  try:
    cli.check_writable(args.out)  # before minutes of compiles, not after them
  except OSError as e:
    parser.error(str(e))
  targets.prepare_environment()

  def search() -> int:
    from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
    if like is not None and not args.like_any:
      _check_shapes(args, like)
    result = (plan_lib.with_slots(args.config, args.target, like, args.slots) if args.slots
              else plan_lib.plan(args.config, args.target, like, meshes))
    if like is not None:
      result["like_path"] = args.like
    check.save(result, args.out)
    if not result["fits"]:
      return cli.error(f"{result['verdict']} (the plan: {args.out})", prefix=PROG)
    print(result["verdict"], flush=True)
    return 0

  return cli.guarded(search, debug=args.debug, prefix=PROG)
