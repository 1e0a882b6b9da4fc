"""A run by wall time: checkpoints and exports every so many minutes, and a budget of
hours within which the run stops usable (docs/data.md, "A run on a budget").

  clock = budget.RunClock(config, time.monotonic(), *plan_step.plan_estimate(config))
  clock.checkpoint.due(now); with clock.checkpoint.timed(): ...   # and clock.export
  clock.stepped(step_seconds, now); clock.room_for_another(now, evaluating=...)
  clock.start_lines(step, eval_problems, now); clock.progress_line(step, now)

Times count from the trainer's start (`start`; loading the model included).
`train.checkpoint_every_minutes` and `train.export_every_minutes` (0: off) count from
it and from the last checkpoint or export, whatever caused it; they act between steps,
beside `train.checkpoint_every`, so a killed run loses at most that many minutes and a
step. `train.budget_hours` (0: none): after each step the run takes another only if a
step as measured and the end's evaluation, checkpoint and export (as last measured)
still fit; otherwise the step just taken is the last, evaluated, checkpointed and
exported. The first step of a process always runs: nothing is measured yet (its time
includes the compiles).

`train.budget_plan` names a plan of `python -m exgrpo_jax.aot plan` for the run's
config and device; its mid-length step (`exgrpo_jax.aot.plan_step`, which the entry
point hands the trainer) sizes the budget in the start-up lines, and measured steps take
over from the first one on.
"""

import contextlib
import datetime
import math
import statistics
import time

from exgrpo_jax.training import run_log


def unplanned(config) -> tuple[None, str]:
  """(no estimate, the note saying why) for a run whose entry point read no plan."""
  if not config.train.budget_plan:
    return None, ("no step estimate (train.budget_plan, a plan of `python -m "
                  "exgrpo_jax.aot plan` for this config and device, is empty)")
  return None, ("no step estimate (train.budget_plan is read by `python -m "
                "exgrpo_jax.train`)")


def _s(seconds: float) -> str:
  """Seconds to say: whole above 10, two figures below."""
  return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.2g}"


class Cadence:
  """Something due every `minutes` of wall time (0: never), counted from `start` and
  from each `done`; `took` is how long the last one took (None before the first)."""

  def __init__(self, minutes: float, start: float):
    self.minutes = minutes
    self.last = start
    self.took = None

  def due(self, now: float) -> bool:
    return self.minutes > 0 and now - self.last >= self.minutes * 60

  def done(self, now: float, took: float) -> None:
    self.last, self.took = now, took

  @contextlib.contextmanager
  def timed(self):
    """Times what the block does as one of these (done when it ends without error)."""
    start = time.monotonic()
    yield
    now = time.monotonic()
    self.done(now, now - start)


class RunClock:
  """The run's wall-time cadences and budget (times in `time.monotonic()` seconds);
  `estimate` and `note` are `plan_estimate`'s."""

  def __init__(self, config, start: float, estimate: dict | None = None, note: str = ""):
    t = config.train
    self.config = config
    self.start = start
    self.checkpoint = Cadence(t.checkpoint_every_minutes, start)
    self.export = Cadence(t.export_every_minutes, start)
    self.evaluation = Cadence(0.0, start)  # never due: keeps the last evaluation's time
    self.budget_s = t.budget_hours * 3600
    self.estimate, self.note = estimate, note
    self._steps = []  # this process's step seconds
    self._first_end = None

  # --- measurements -------------------------------------------------------------------------

  def stepped(self, seconds: float, now: float) -> None:
    self._steps.append(seconds)
    if self._first_end is None:
      self._first_end = now

  def step_s(self) -> float | None:
    """A step as measured: the median of this process's steps after its first (which
    compiles), or the first alone."""
    return statistics.median(self._steps[1:] or self._steps) if self._steps else None

  def _all_in_s(self, now: float) -> float:
    """A step with its share of evaluations, checkpoints and exports: the time since the
    first step ended over the steps since (the measured step until there are any)."""
    if len(self._steps) < 2:
      return self.step_s()
    return (now - self._first_end) / (len(self._steps) - 1)

  def _eval_s(self, eval_rows: int) -> float:
    """An evaluation: as last measured, else `eval_rows` rows at the rollout's pace
    (the plan's, or a measured step's)."""
    if self.evaluation.took is not None:
      return self.evaluation.took
    rows = self.config.train.batch_questions * self.config.rollout.k
    per_step = self.estimate["rollout_s"] if self.estimate else self.step_s() or 0.0
    return per_step * eval_rows / rows

  def _end_s(self) -> float:
    """The end's evaluation, checkpoint and export, as last measured."""
    t = self.config.train
    return ((self.evaluation.took or 0.0) * bool(self.config.eval.every)
            + (self.checkpoint.took or 0.0) + (self.export.took or 0.0) * bool(t.export_dir))

  # --- the budget ---------------------------------------------------------------------------

  def room_for_another(self, now: float, evaluating: bool) -> bool:
    """Whether another step and the end's work fit in the budget after the step just
    taken (and its evaluation, where `evaluating`); always without a budget."""
    if not self.budget_s:
      return True
    left = self.budget_s - (now - self.start) - evaluating * (self.evaluation.took or 0.0)
    return left >= self.step_s() + self._end_s()

  def start_lines(self, step: int, eval_problems: int, now: float) -> list[str]:
    """What the rest of the budget buys from `step` on: steps at the plan's estimate
    (where there is one), evaluations of `eval_problems`, checkpoints and exports."""
    c = self.config
    head = f"budget {c.train.budget_hours:g} h"
    left = c.train.steps - step
    each_eval = self._eval_s(eval_problems * c.eval.n)
    if self.estimate is None:
      steps, per_step = None, 0.0
      first = (f"{head}: {self.note}: the steps it holds are counted from measured "
               "steps as the run goes")
    else:
      per_step = self.estimate["step_s"] + (each_eval / c.eval.every if c.eval.every else 0)
      steps = min(left, max(int((self.budget_s - (now - self.start)) // per_step), 0))
      held = (f"the remaining {left} steps" if steps == left
              else f"about {steps} of the remaining {left} steps")
      first = f"{head}: {held} at {_s(self.estimate['step_s'])} s a step ({self.note})"
    return [first, f"{head}: " + ", ".join(
        self._cadences(steps, per_step, eval_problems, each_eval))]

  def _cadences(self, steps: int | None, per_step: float, eval_problems: int,
                each_eval: float) -> list[str]:
    """The evaluations, checkpoints and exports; how many `steps` hold, where known."""
    c, t = self.config, self.config.train
    count = lambda every: "" if steps is None else f"about {-(-steps // every)} "
    parts = []
    if c.eval.every:
      parts.append(f"{count(c.eval.every)}evaluations on {eval_problems} problems (every "
                   f"{c.eval.every} steps" + (f", about {_s(each_eval)} s each)"
                                               if each_eval else ")"))
    minutes = t.checkpoint_every_minutes
    parts.append(f"{count(_every(minutes, per_step, t.checkpoint_every))}checkpoints (every "
                 f"{t.checkpoint_every} steps" + (f" or {minutes:g} min)" if minutes else ")"))
    if t.export_dir:
      minutes = t.export_every_minutes
      parts.append(f"{count(_every(minutes, per_step, max(steps or 1, 1)))}exports to "
                   f"{t.export_dir} (" + (f"every {minutes:g} min and " if minutes else "")
                   + "at the end)")
    return parts

  def _ahead(self, step: int, now: float) -> tuple[int, float]:
    """(steps, seconds) until the run stops: the steps the rest of the budget holds at
    the pace measured so far, and the time they and the end's work take."""
    all_in, end_s = max(self._all_in_s(now), 1e-9), self._end_s()
    left = self.config.train.steps - step
    more = min(left, max(int((self.budget_s - (now - self.start) - end_s) // all_in), 0))
    return more, more * all_in + end_s

  def eta_s(self, step: int, now: float) -> float | None:
    """Seconds until the budget's run stops (None without a budget)."""
    return self._ahead(step, now)[1] if self.budget_s else None

  def progress_line(self, step: int, now: float) -> str:
    """Where the budget stands after `step`, from the steps measured so far."""
    elapsed, all_in = now - self.start, self._all_in_s(now)
    left = self.config.train.steps - step
    more, until = self._ahead(step, now)
    at = datetime.datetime.now() + datetime.timedelta(seconds=until)
    held = f"the remaining {left} steps" if more == left else f"about {more} more steps"
    return (f"budget: step {step} at {run_log.hms(elapsed)} of {run_log.hms(self.budget_s)}, "
            f"{_s(self.step_s())} s a step measured ({_s(all_in)} s with evaluations, "
            f"checkpoints and exports); the rest holds {held}: the run stops near step "
            f"{step + more}, in {run_log.hms(until)} ({at:%Y-%m-%d %H:%M})")

  def stop_line(self, step: int, now: float) -> str:
    return (f"budget: stopping after step {step}, {run_log.hms(now - self.start)} of "
            f"{run_log.hms(self.budget_s)} spent: another step ({_s(self.step_s())} s) with the end's "
            f"evaluation, checkpoint and export ({_s(self._end_s())} s) would pass it; they "
            "follow for this step, then the run ends (rerun the command to train on with a "
            "new budget)")


def _every(minutes: float, per_step: float, steps: int) -> int:
  """Steps from one checkpoint (or export) to the next: `steps`, or fewer where
  `minutes` of wall time at `per_step` seconds a step come first."""
  if minutes and per_step:
    return max(1, min(steps, math.ceil(minutes * 60 / per_step)))
  return max(steps, 1)
