r"""The planner: a config's mesh, micro-batch, rollout slots and KV pool for a target,
chosen from the compiler's figures (`python -m exgrpo_jax.aot plan`, `plan_cli`).

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
Where no mesh fits even STEP slots with their rows reserved at their longest (small
hardware, long responses), each mesh whose learner fits takes STEP slots over the
largest pool that fits (`Planner.bounded`; `reserved_rows`: the rows that pool holds at
their longest, the rollout without admission). Otherwise each fitting
mesh's whole training step is compiled with those settings
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

import ctypes
import gc
import math
import os
import re
import sys

from exgrpo_jax import config_cli
from exgrpo_jax.aot import targets

GIB = 2 ** 30
STEP = 64
ADMISSION_TRIES = 4  # compiles of the capacity, each lowered by what the last lacked


def is_plan(data) -> bool:
  """Whether a JSON value is a plan this module wrote (not another tool's JSON)."""
  return isinstance(data, dict) and {"config", "target", "fits", "usable_gib",
                                     "verdict"} <= set(data)


def margin_gib(plan_: dict) -> float:
  """The memory a plan keeps free below its usable memory (`targets.MARGIN`); plans
  written before margins were kept have it from their target's platform."""
  if "margin_gib" in plan_:
    return plan_["margin_gib"]
  return plan_["usable_gib"] * targets.MARGIN[targets.get(plan_["target"]).platform]


def config_name(spec: str) -> str:
  """A config's short name, `configs/qwen7b.py[:ARG]` -> `qwen7b[:ARG]`."""
  path, _, arg = spec.partition(":")
  return os.path.basename(path).removesuffix(".py") + (f":{arg}" if arg else "")


def configured(spec: str, tensor: int, devices: int, micro: int, max_rows: int,
               kv_pages: int = 0):
  """The config file `spec` at a mesh of `tensor`, a micro-batch, slots and a pool."""
  config = config_cli.load(spec)
  with config.unlocked():
    config.mesh.shape = (devices // tensor, tensor)
    config.optim.micro_batch_size = micro
    config.rollout.max_rows = max_rows
    config.rollout.kv_pages = kv_pages
  return config


def _peaks(report: dict) -> dict:
  """Each program's device peak (GiB); where it failed to compile, what its error says
  it needed, or None where the error does not say."""
  def peak(p):
    if not p["error"]:
      return p["device_peak_bytes"] / GIB
    need = _need(p["error"])
    return None if math.isinf(need) else need
  return {p["name"]: peak(p) for p in report["programs"]}


def _need(failure: str) -> float:
  """The GiB per device a failed compile asked for (inf where its error does not say)."""
  need = re.search(r"([\d.]+) GiB (?:needed|per device)", failure)
  return float(need[1]) if need else math.inf


def release_host_memory() -> None:
  """Frees what a compile leaves on the host. JAX's caches keep every compiled program
  and glibc keeps the freed heap: a compile of a 7B rollout for a v4-8 left 4-5 GB
  each, 15 GB after three, where with both released 0.8 GB stays (2026-12-06), so a
  search of a dozen compiles no longer runs a 24 GB host out of memory."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.clear_caches()
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):  # not glibc: nothing to hand back this way
    pass


class Planner:
  """Runs the compiles of one config on one target and keeps what each one said."""

  def __init__(self, spec: str, target: str):
    from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
    self.check, self.spec_path, self.target = check, spec, target
    self.name = config_name(spec)
    self.spec = targets.get(target)
    self.usable = targets.usable_bytes(self.spec) / GIB
    self.margin = targets.margin_bytes(self.spec) / GIB
    self.ceiling = self.usable - self.margin  # what a chosen program may peak at
    self.search, self.skipped = [], []

  def compile(self, tensor, micro, max_rows, parts, kv_pages=0) -> dict:
    config = configured(self.spec_path, tensor, self.spec.devices, micro, max_rows, kv_pages)
    print(f"[plan] {self.name} {self.target} tensor={tensor} micro={micro} "
          f"max_rows={max_rows} kv_pages={kv_pages} {'+'.join(parts)}", file=sys.stderr,
          flush=True)
    report = self.check.run(config, self.target, parts=parts, progress=lambda _: None)
    release_host_memory()
    self.search.append(dict(tensor=tensor, micro_batch_size=micro, max_rows=max_rows,
                            kv_pages=kv_pages, parts=list(parts), ok=report["ok"],
                            first_failure=report["first_failure"],
                            device_peak_gib=_peaks(report)))
    return report

  def learner(self, tensor: int, micro: int) -> int:
    """The largest micro-batch (halving from `micro`) whose learner programs fit; 0: none.
    A failure whose need does not shrink with the micro-batch (the parameters and
    optimizer state alone) ends the halving."""
    need = math.inf
    while micro >= 1:
      report = self.compile(tensor, micro, STEP, ("learner",))
      if report["ok"]:
        return micro
      now = max((v for v in _peaks(report).values() if v is not None), default=math.inf)
      if math.isfinite(now) and now >= need:
        self._skip(tensor, f"learner: {now:.2f} GiB at micro-batch {micro} as at "
                   f"{2 * micro}", int(math.log2(micro)))
        return 0
      need, micro = now, micro // 2
    return 0

  def rollout(self, tensor: int, rows: int, unit: int) -> int:
    """The most rows per call (a multiple of `unit`, at most `rows`) that fit; 0: none.
    Fewer rows than STEP are not searched, so a failure at STEP ends it (a program
    whose peak does not move with the rows, the weights' copy, fails at every count);
    otherwise each program's peak, affine in the rows, points at the first count to
    compile, and the search bisects from there: in steps of STEP, then of `unit`."""
    seen = {}

    def peaks(n):
      if n not in seen:
        report = self.compile(tensor, 1, n, ("rollout",))
        seen[n] = report["ok"], _peaks(report), report["first_failure"]
      return seen[n]

    fits = lambda n: peaks(n)[0]
    if rows <= STEP:  # a small batch: all its rows in one call, or none
      return rows if fits(rows) else 0
    if not fits(STEP):
      self._skip(tensor, f"rollout at {STEP} rows: {peaks(STEP)[2]}", rows // unit - 1)
      return 0
    guess = _largest(peaks(STEP)[1], peaks(4 * STEP)[1], STEP, 4 * STEP, self.ceiling,
                     rows, STEP)
    best = self._bisect(fits, STEP, rows // STEP * STEP, STEP, guess)
    failed = min([n for n, (ok, *_) in seen.items() if not ok and n > best], default=None)
    top = min(failed or rows + unit, best + STEP, rows + unit) - unit
    if top > best:
      fine = top if failed is None else _largest(peaks(best)[1], peaks(failed)[1], best,
                                                  failed, self.ceiling, top, unit)
      best = self._bisect(fits, best, top, unit, fine)
    counts = {n for n in range(STEP, rows + 1, unit)}
    self._skip(tensor, f"rollout: bisected to {best} rows", len(counts - set(seen)))
    return best

  @staticmethod
  def _bisect(fits, low: int, high: int, unit: int, guess: int) -> int:
    """The largest `low + j * unit` at most `high` that fits (`low` does; fitting only
    gets harder with more rows): `guess` and the count above it compiled first, then
    halving what is left."""
    grid = lambda n: low + max(0, min(n, high) - low) // unit * unit
    for probe in (grid(guess), grid(guess) + unit):
      if low < probe <= high:
        if not fits(probe):
          high = probe - unit
          break
        low = probe
    while low < high:
      mid = low + ((high - low) // unit + 1) // 2 * unit
      low, high = (mid, high) if fits(mid) else (low, mid - unit)
    return low

  def _skip(self, tensor: int, reason: str, counts: int) -> None:
    """Records settings the search did not compile because `reason` decides them."""
    self.skipped.append(dict(tensor=tensor, reason=reason, compiles=counts))


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
      pages -= self._lacking(report, page_bytes, pages // shards) * shards
    return None

  def _lacking(self, report: dict, page_bytes: float, per_shard: int) -> int:
    """The pages per batch shard a failed compile's costliest program lacked (a tenth
    of `per_shard` where its error does not say how much)."""
    over = max((p["device_peak_bytes"] - self.ceiling * GIB if not p["error"]
                else (_need(p["error"]) - self.ceiling) * GIB) for p in report["programs"])
    return math.ceil(max(over, 0) / page_bytes) + 1 if math.isfinite(over) else per_shard // 10

  def like(self, like: dict, headroom: float) -> tuple[dict, dict]:
    """`like`'s choice compiled for this config (the micro-batch halved while the
    learner does not fit), then its pool moved to what that compile holds (`readmit`):
    (the last report, its settings)."""
    from exgrpo_jax.aot import lengths  # pylint: disable=g-import-not-at-top
    c = like["chosen"]
    tensor, micro = c["tensor"], c["micro_batch_size"]
    pages, slots = lengths.capacity_pages(like), c["max_rows"]
    while True:
      report = self.compile(tensor, micro, slots, ("learner", "rollout"), kv_pages=pages)
      learner_ok = all(p["fits"] for p in report["programs"]
                       if p["name"] in self.check.LEARNER)
      if learner_ok or micro == 1:
        break
      micro //= 2
    best = dict(tensor=tensor, micro_batch_size=micro, max_rows=slots, kv_pages=pages,
                reserved_rows=c.get("reserved_rows", slots))
    if not learner_ok:
      return report, best
    found = self.readmit(best, report, headroom)
    if found is None:
      return report, best
    report, slots, pages = found
    from exgrpo_jax.aot import lengths  # pylint: disable=g-import-not-at-top
    per_row = lengths.row_pages(report)
    best.update(max_rows=slots, kv_pages=pages, reserved_rows=min(
        best["reserved_rows"], pages // per_row) if pages else slots)
    return report, best

  def readmit(self, best: dict, report: dict, headroom: float):
    """A compiled step's pool (`report`, at `best`'s slots and `kv_pages`) moved to the
    pages the memory holds beside its decode (`pool_bound`), its slots re-chosen over
    them as `admission` chooses (`lengths.best_slots` from `best`'s reserved rows, so a
    pricing that now favours fewer slots moves them down), and the pages lowered by
    what the costliest program lacked until every program fits; where the reserved rows
    cost least and the pages hold them, each row has its pages at its longest (`pages`
    0). Where the compile fits with the slots and pool it would choose, nothing is
    compiled. Returns (report, slots, pages), or None where nothing fits."""
    from exgrpo_jax.aot import lengths  # pylint: disable=g-import-not-at-top
    b = report["batch"]
    shards, page_bytes = lengths.kv_layout(report)
    per_row, pages, slots = lengths.row_pages(report), best["kv_pages"], best["max_rows"]
    fitting = (report, slots, pages) if report["ok"] else None
    bound = int(pool_bound(report) * per_row) // shards * shards
    dists = lengths.distributions(b["response_tokens"], b["questions"] * b["k"])
    mid = dists.pop("mid")
    today = lengths.rollout_estimate(report, mid, slots=best.get("reserved_rows", slots))
    if fitting:  # a larger pool, else this one with its slots re-chosen
      floor, pages = pages, max(bound, pages)
    else:  # the bound reads the decode; another program may bind first
      floor = per_row * shards
      pages = min(bound, pages - self._lacking(report, page_bytes, pages // shards) * shards)
    for _ in range(ADMISSION_TRIES):
      if pages < floor:
        break
      chosen = lengths.best_slots(report, mid, headroom, today, capacity=pages,
                                  also=dists.values())
      slots = chosen["slots"]
      if chosen is today and pages >= today["capacity_pages"]:
        pages = 0  # the reserved rows cost least and fit: each its pages at its longest
      if fitting and (slots, pages) == fitting[1:]:
        return fitting
      trial = self.compile(best["tensor"], best["micro_batch_size"], slots,
                           ("learner", "rollout"), kv_pages=pages)
      if trial["ok"]:
        return trial, slots, pages
      if (fitting and pages == floor) or not pages:
        break
      pages -= self._lacking(trial, page_bytes, pages // shards) * shards
      if fitting:  # down to the fitting pool at most, where the re-chosen slots are tried
        pages = max(pages, floor)
    return fitting

  def bounded(self, tensor: int, micro: int) -> tuple[dict, int, int] | None:
    """Where not even STEP slots fit with every row's pages reserved at its longest:
    the whole step at STEP slots over the largest pool that fits, the pages lowered from
    every row's by what the costliest program lacked. (report, pages, the rows the pool
    holds at their longest), or None where not one row's pages fit."""
    from exgrpo_jax.aot import lengths  # pylint: disable=g-import-not-at-top
    report = self.compile(tensor, micro, STEP, ("learner", "rollout"))
    shards, page_bytes = lengths.kv_layout(report)
    per_row = lengths.row_pages(report)
    pages = per_row * STEP // shards * shards
    for _ in range(ADMISSION_TRIES):
      if report["ok"]:
        return report, pages, pages // per_row
      pages -= self._lacking(report, page_bytes, pages // shards) * shards
      if pages < per_row * shards:
        return None
      report = self.compile(tensor, micro, STEP, ("learner", "rollout"), kv_pages=pages)
    return (report, pages, pages // per_row) if report["ok"] else None


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


def _flags(devices: int, best: dict, base) -> str:
  """The `--config.*` flags that give a config `best`'s settings."""
  flags = (f"--config.mesh.shape='({devices // best['tensor']}, {best['tensor']})' "
           f"--config.rollout.max_rows={best['max_rows']}")
  if best["kv_pages"]:
    flags += f" --config.rollout.kv_pages={best['kv_pages']}"
  if best["micro_batch_size"] != base.optim.micro_batch_size:
    flags += f" --config.optim.micro_batch_size={best['micro_batch_size']}"
  return flags


def with_slots(spec: str, target: str, like: dict, slots: int) -> dict:
  """`like`'s plan (a fitting one, of `spec` or a config of its shapes) compiled with
  `slots` rollout slots over its own pool (`lengths.capacity_pages`): whether a slot count the
  estimate recommends fits, and its report."""
  planner = Planner(spec, target)
  base = config_cli.load(spec)
  c = like["chosen"]
  from exgrpo_jax.aot import lengths  # pylint: disable=g-import-not-at-top
  best = dict(c, max_rows=slots, kv_pages=lengths.capacity_pages(like))
  final = planner.compile(c["tensor"], c["micro_batch_size"], slots, ("learner", "rollout"),
                          kv_pages=best["kv_pages"])
  flags = _flags(planner.spec.devices, best, base)
  return dict(config=spec, target=target, usable_gib=planner.usable,
              margin_gib=planner.margin, like_target=like["target"], candidates=[],
              search=planner.search, searched_as=like["config"], slots_of=like["chosen"],
              fits=final["ok"], chosen=dict(best, flags=flags), report=final,
              verdict=final["first_failure"] or f"fits: {flags}")


def plan(spec: str, target: str, like: dict | None = None,
         meshes: tuple[int, ...] = ()) -> dict:
  """The search and the chosen settings' report for the config file `spec`
  (`FILE.py[:ARG]`). `like`, a fitting plan of a config of the same shapes on this
  target (its own included), skips the search: its choice is compiled for `spec` and
  its pool moved to what this config's compile holds (`Planner.readmit`); with
  `meshes`, its candidates of those tensor sizes are settled and the mesh chosen among
  them. Every verdict comes from a compile of `spec`. `fits` is False where nothing
  fits, and `verdict` says why."""
  planner = Planner(spec, target)
  name = planner.name
  base = config_cli.load(spec)
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
  result = dict(config=spec, target=target, usable_gib=planner.usable,
                margin_gib=planner.margin, candidates=candidates, search=planner.search,
                skipped=planner.skipped, searched_as=like["config"] if like else None,
                like_target=like["target"] if like else None)
  if like and meshes:
    fitting = [dict(tensor=c["tensor"], micro_batch_size=c["micro_batch_size"],
                    max_rows=c["max_rows"]) for c in like["candidates"]
               if c["tensor"] in meshes and c["micro_batch_size"] and c["max_rows"]]
  if like and not meshes:
    settled = [planner.like(like, base.rollout.kv_headroom)]
  else:
    settled = [_settle(planner, c, base) for c in fitting]
  if not fitting and not like:  # STEP slots over a pool smaller than their rows at the longest
    for c in (c for c in candidates if c["micro_batch_size"]):
      found = planner.bounded(c["tensor"], c["micro_batch_size"])
      if found:
        report, pages, rows = found
        settled.append((report, dict(c, max_rows=STEP, reserved_rows=rows, kv_pages=pages)))
  settled = [s for s in settled if s[0]["ok"]]
  if not settled:
    least = min((s for s in planner.search if s["first_failure"]),
                key=lambda s: _need(s["first_failure"]))
    return dict(result, fits=False, verdict=(
        f"{name} does not fit {target} at any mesh or micro-batch"
        f"{' tried' if like else ''}; the least: mesh "
        f"{planner.spec.devices // least['tensor']} x {least['tensor']}, micro-batch "
        f"{least['micro_batch_size']}: {least['first_failure']}"))
  mid_s = [mid_step_s(dict(report=report, chosen=s), base.rollout.kv_headroom)
           for report, s in settled]
  final, best = settled[mid_s.index(min(mid_s))]
  flags = _flags(planner.spec.devices, best, base)
  return dict(result, fits=True, chosen=dict(best, flags=flags), report=final,
              verdict=f"fits: {flags}",
              settled=[dict(s, mid_step_s=m) for (_, s), m in zip(settled, mid_s)])


def _settle(planner, candidate: dict, base) -> tuple[dict, dict]:
  """A mesh's whole step compiled at its reserved rows, then with admission
  (`Planner.admission`): (its report, its settings with `reserved_rows` and `kv_pages`,
  0 without admission)."""
  best = dict(candidate, reserved_rows=candidate["max_rows"], kv_pages=0)
  final = planner.compile(best["tensor"], best["micro_batch_size"], best["max_rows"],
                          ("learner", "rollout"))
  pooled = any(p["name"] == "decode_chunk" for p in final["programs"])  # else static
  admitted = final["ok"] and pooled and planner.admission(best, final,
                                                           base.rollout.kv_headroom)
  if admitted:
    final, slots, pages = admitted
    best.update(max_rows=slots, kv_pages=pages)
  return final, best


def mid_step_s(plan_: dict, headroom: float) -> float:
  """A plan's step as compiled at the mid length scenario (`step_lengths.plan_step`: the
  rollout admitting in its slots over its pool, the recompute and the learner at the
  same lengths); inf where it does not fit."""
  from exgrpo_jax.aot import lengths  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import step_lengths  # pylint: disable=g-import-not-at-top
  report = plan_["report"]
  if not report["ok"]:
    return math.inf
  b = report["batch"]
  mid = lengths.scenario("mid", b["response_tokens"], b["questions"] * b["k"])
  return step_lengths.plan_step(plan_, mid, headroom)["total_s"]


def pool_bound(report: dict) -> float:
  """Rows per call the pool leaves room for (an estimate from the compiler's figures): the
  usable memory less the margin and decode_chunk's device peak without its pool (what stays resident,
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
  return (decode["usable_bytes"] - decode.get("margin_bytes", 0) - fixed) / row_bytes


