"""The learner's and the old-log-prob recompute's seconds at real response lengths, and
one whole-step estimate per length distribution.

  est = learner_estimate(report, lengths_R)   # learner_s, recompute_s, micro-batches
  seconds = priced(report, measured_step)     # a measured step's phases, at its lengths
  print(step_table(plans))                    # rollout + recompute + learner per plan

`check.step_estimate` prices both with every response at `rollout.max_new_tokens`: one
sequence per row. The trainer packs sequences of their real lengths into rows of
T = P + R tokens (`training.packing`, first fit by decreasing length), so shorter
responses fill fewer rows:

  learner    the actor splits a step's B x K responses into `optim.mini_batches` random
             parts, each packed into micro-batches of `optim.micro_batch_size` rows; the
             compiled `learner_step` scans its M micro-batches and skips the empty ones
             (`learner.accumulate_gradients`). A call with n non-empty micro-batches is
             priced by the roofline (`analysis.bound_s`) of n / M of its FLOPs and its
             bytes once per call: its parameters, optimizer state and batch are read and
             written whatever n.
  recompute  every fresh response is packed at once (`experience.score_rows`) and
             scored `micro_batch_size` rows a call, the last call a power of two: each
             priced like `score` as compiled, its FLOPs in proportion to its rows.

Prompts stay at the compiled `data.max_prompt_tokens` (T as compiled); the parts are a
fixed random split (the actor draws a new one each step). At every response at the cap,
both equal `check.step_estimate`'s figures.
"""

import re

import numpy as np

from exgrpo_jax.aot import lengths as lengths_lib
from exgrpo_jax.training import experience
from exgrpo_jax.training import packing


def _program(report: dict, name: str) -> dict:
  return next(p for p in report["programs"] if p["name"] == name)


def _shape(report: dict) -> tuple[int, int, int]:
  """(M micro-batches a learner call scans, rows per micro-batch, T tokens a row), as
  `learner_step` was compiled."""
  found = re.match(r"one optimizer step: (\d+) micro-batches of (\d+) rows x (\d+) tokens",
                   _program(report, "learner_step")["purpose"])
  return tuple(map(int, found.groups()))


def _seconds(program: dict, share: float, target: dict) -> float:
  """A compiled program's roofline with `share` of its FLOPs and all its bytes per call
  (`analysis.roofline`'s terms)."""
  from exgrpo_jax.aot import analysis  # pylint: disable=g-import-not-at-top
  return float(analysis.bound_s(share * program["flops_per_device"],
                                analysis.call_bytes(program), target))


def micro_batches(lengths_R, prompt_tokens: int, prompt_len: int, response_len: int,
                  micro: int, parts: int, pack: bool = True, seed: int = 0) -> list[int]:
  """Per mini-batch, the micro-batches its packed rows fill (`Actor.update`'s split)."""
  order = np.random.default_rng(seed).permutation(len(lengths_R))
  lengths_R = np.asarray(lengths_R)
  return [-(-packing.place(np.full(len(part), prompt_tokens), lengths_R[part], prompt_len,
                           response_len, pack).num_rows // micro)
          for part in np.array_split(order, parts)]


def score_calls(lengths_R, prompt_tokens: int, prompt_len: int, response_len: int,
                micro: int, pack: bool = True) -> list[int]:
  """The rows of each scoring call over all responses packed at once (`score_rows`)."""
  rows = packing.place(np.full(len(lengths_R), prompt_tokens), lengths_R, prompt_len,
                       response_len, pack).num_rows
  return experience.call_sizes(rows, micro)


def learner_estimate(report: dict, lengths_R, fresh_R=None) -> dict:
  """The learner's roofline seconds for responses of `lengths_R` and the recompute's for
  the fresh ones among them, `fresh_R` (default: all; see the module docstring), with
  the micro-batches and scoring calls they take."""
  b, target = report["batch"], report["target"]
  M, micro, T = _shape(report)
  R = b["response_tokens"]
  pack = b.get("packing", True)
  step, score = _program(report, "learner_step"), _program(report, "score")
  filled = micro_batches(lengths_R, b["prompt_tokens"], T - R, R, micro, b["mini_batches"],
                         pack)
  calls = score_calls(lengths_R if fresh_R is None else fresh_R, b["prompt_tokens"], T - R,
                      R, micro, pack)
  recompute = score["calls_per_step"] > 0
  return dict(
      learner_s=sum(_seconds(step, n / M, target) for n in filled),
      recompute_s=sum(_seconds(score, rows / micro, target) for rows in calls)
      if recompute else 0.0,
      micro_batches=filled, micro_batches_compiled=M, score_calls=len(calls) * recompute)


def priced(report: dict, step: dict) -> dict:
  """The roofline seconds of a measured step's phases at its own lengths: the rollout
  over its fresh rows (`rollout_seconds`), the recompute over them and the learner over
  every row it trained on (`learner_estimate`). `step`: `response_lens` and `fresh_lens`,
  as the measuring scripts record them."""
  learner = learner_estimate(report, step["response_lens"], fresh_R=step["fresh_lens"])
  return dict(rollout=rollout_seconds(report, step["fresh_lens"]),
              recompute=learner["recompute_s"], learner=learner["learner_s"])


# Measured on a device, as a share of the roofline's bound (docs/accelerator_results.md):
# the learner's MFU at S = 9,216 with cuDNN attention (`auto` on NVIDIA GPUs), and decode
# at batch 1, the only measurement at a billion-parameter shape (launch-bound: larger
# batches should do better, so this errs slow). Keyed by the device the target names.
MEASURED = {
    "NVIDIA H200": dict(learner=0.252, decode=0.34,
                        source="one H200, Qwen2.5-1.5B shape, 2026-11-26"),
}


def at_measured(target: dict, rollout_s: float, learner_s: float) -> float | None:
  """A step's seconds at its device's measured efficiency (`MEASURED`): the rollout at
  decode's, the recompute and the learner (`learner_s`, both) at the learner's; None
  where the device has no measurement."""
  measured = MEASURED.get(target.get("device_kind"))
  if measured is None:
    return None
  return rollout_s / measured["decode"] + learner_s / measured["learner"]


def rollout_seconds(report: dict, lengths_R) -> float:
  """The rollout's roofline seconds for fresh rows of `lengths_R`: continuous batching's
  by its scheduler (`lengths.rollout_estimate`), or the static loop's, whose calls of
  `generate` each decode until their longest row ends (its FLOPs and streamed bytes in
  proportion), beside the rollout's other programs as compiled."""
  programs = {p["name"]: p for p in report["programs"]}
  if "generate" not in programs:
    return lengths_lib.rollout_estimate(report, lengths_R)["rollout_s"]
  from exgrpo_jax.aot import analysis  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
  target, N = report["target"], report["batch"]["response_tokens"]
  generate = programs["generate"]
  per_call = int(re.match(r"prefill and decode (\d+) rows", generate["purpose"])[1])
  fixed = analysis.call_bytes(generate)
  streamed = (generate["hbm_bytes_per_call"] - fixed) / N
  lengths_R = np.asarray(lengths_R)
  seconds = sum(float(analysis.bound_s(generate["flops_per_device"] * m / N,
                                       fixed + m * streamed, target))
                for m in (lengths_R[i:i + per_call].max()
                          for i in range(0, len(lengths_R), per_call)))
  others = sum(p["roofline_s"] * p["calls_per_step"] for p in report["programs"]
               if p["name"] not in check.LEARNER and p["name"] != "generate"
               and not p["name"].startswith("eval_"))
  return seconds + others


def recommended(plan: dict, lengths_R, headroom: float, admitting: dict) -> str:
  """The slot count whose rollout costs least at `lengths_R` over the plan's own pool
  (`lengths.best_slots`, from the plan's own slots `admitting` there), its seconds, and
  whether the plan compiled it: one it did not
  is compiled by `python -m exgrpo_jax.aot plan --like PLAN --slots N`."""
  best = lengths_lib.best_slots(plan["report"], lengths_R, headroom, admitting,
                                capacity=lengths_lib.capacity_pages(plan))
  compiled = best["slots"] == plan["report"]["batch"]["max_rows"]
  return f"{best['slots']} ({best['rollout_s']:.0f} s{'' if compiled else ', not compiled'})"


def plan_step(plan: dict, lengths_R, headroom: float, admitting: dict | None = None) -> dict:
  """One training step of `plan` as compiled, at responses of `lengths_R` (roofline s):
  the rollout in its slots over its pool, admitting (`lengths.admitting_estimate`; the
  one given; the static loop's calls, `rollout_seconds`), the recompute and the learner packed at the same lengths. The plan's JSON
  (`settled[].mid_step_s`), `--render` and `--estimate` all give this at the mid lengths."""
  if admitting is None:
    static = any(p["name"] == "generate" for p in plan["report"]["programs"])
    admitting = (dict(rollout_s=rollout_seconds(plan["report"], lengths_R)) if static
                 else lengths_lib.admitting_estimate(plan, lengths_R, headroom))
  est = learner_estimate(plan["report"], lengths_R)
  return dict(rollout_s=admitting["rollout_s"], recompute_s=est["recompute_s"],
              learner_s=est["learner_s"],
              total_s=admitting["rollout_s"] + est["recompute_s"] + est["learner_s"])


def step_table(plans: list[tuple[str, dict]], headroom: float = 0.1, **given) -> str:
  """Markdown: per plan and length distribution (`lengths.distributions`), the roofline
  seconds of the rollout in today's slots and with admission (`lengths.today_estimate`,
  `lengths.admitting_estimate`), the old-log-prob recompute, the learner, the whole step
  both ways, the part that dominates it, the step at the device's measured efficiency
  (`at_measured`, with the measurements' source below), and the slot count that would
  roll out fastest over the plan's pool (`recommended`)."""
  lines = ["| config | target | lengths | rollout s | admitting, rollout s | recompute s "
           "| learner s | step s | admitting, step s | largest part (admitting) "
           "| admitting, at measured efficiency s | fastest slots over its pool |",
           "|" + "---|" * 12]
  sources = {}
  for name, plan in plans:
    report = plan["report"]
    b = report["batch"]
    for label, lengths_R in lengths_lib.distributions(
        b["response_tokens"], b["questions"] * b["k"], **given).items():
      today = lengths_lib.today_estimate(plan, lengths_R)
      admitting = lengths_lib.admitting_estimate(plan, lengths_R, headroom)
      step = plan_step(plan, lengths_R, headroom, admitting)
      rollout, est = step["rollout_s"], step
      parts = dict(rollout=rollout, recompute=est["recompute_s"], learner=est["learner_s"])
      trained = est["recompute_s"] + est["learner_s"]
      measured = at_measured(report["target"], rollout, trained)
      if measured is not None:
        sources[report["target"]["device_kind"]] = MEASURED[report["target"]["device_kind"]]
      lines.append(
          f"| {name} | {plan['target']} | {label} | {today['rollout_s']:.0f} | {rollout:.0f} "
          f"| {est['recompute_s']:.0f} | {est['learner_s']:.0f} "
          f"| {today['rollout_s'] + trained:.0f} | {step['total_s']:.0f} "
          f"| {max(parts, key=parts.get)} "
          f"| {'no measurement' if measured is None else f'{measured:.0f}'} "
          f"| {recommended(plan, lengths_R, headroom, admitting)} |")
  lines += [f"\nAt measured efficiency: {kind}, {m['source']}: the learner at {m['learner']:.1%} "
            f"of its roofline, decode at {m['decode']:.0%}." for kind, m in sources.items()]
  return "\n".join(lines)
