"""The learner's and the recompute's estimates at real lengths (`aot.step_lengths`):
today's figures at the cap, and the packer's own micro-batches at a distribution."""

import glob
import json
import os

import numpy as np
import pytest

from exgrpo_jax.aot import analysis
from exgrpo_jax.aot import lengths
from exgrpo_jax.aot import step_lengths
from exgrpo_jax.training import experience
from exgrpo_jax.training import packing
from tests import conftest

PLANS = sorted(glob.glob(os.path.join(conftest.REPO_ROOT, "docs/results/aot_*_*.json")))


def _plans():
  for path in PLANS:
    with open(path, encoding="utf-8") as f:
      plan = json.load(f)
    if plan.get("fits") and "report" in plan:
      yield os.path.basename(path), plan


@pytest.mark.parametrize("name, plan", list(_plans()))
def test_every_response_at_the_cap_gives_todays_learner_and_recompute(name, plan):
  report = plan["report"]
  b = report["batch"]
  est = step_lengths.learner_estimate(
      report, lengths.at_cap(b["response_tokens"], b["questions"] * b["k"]))
  today = report["step_estimate"]
  assert est["learner_s"] == pytest.approx(today["learner_s"], rel=1e-9), name
  assert est["recompute_s"] == pytest.approx(today["old_logp_recompute_s"], rel=1e-9), name
  assert est["micro_batches"] == [est["micro_batches_compiled"]] * b["mini_batches"]


def _seconds(program, share, target):
  return max(share * program["flops_per_device"] / target["peak_flops"],
             analysis.call_bytes(program) / target["hbm_bandwidth"])


def test_at_a_distribution_the_learner_is_priced_over_the_packers_own_micro_batches():
  with open(os.path.join(conftest.REPO_ROOT, "docs/results/aot_qwen7b_h100x8.json"),
            encoding="utf-8") as f:
    report = json.load(f)["report"]
  b, target = report["batch"], report["target"]
  programs = {p["name"]: p for p in report["programs"]}
  R, rows = b["response_tokens"], b["questions"] * b["k"]
  micro = b["micro_batch_size"]
  M = int(programs["learner_step"]["purpose"].split(" micro-batches")[0].split()[-1])
  T = int(programs["learner_step"]["purpose"].split(" x ")[1].split()[0])
  lengths_R = lengths.scenario("mid", R, rows)
  # The actor's split and packing (`Actor.update`, `packing.train_batch`), built here.
  prompt = np.ones(b["prompt_tokens"], np.int32)
  responses = [packing.Sequence(prompt, np.ones(n, np.int32), np.zeros(n, np.float32))
               for n in lengths_R]
  order = np.random.default_rng(0).permutation(rows)
  filled = []
  for part in np.array_split(order, b["mini_batches"]):
    batch = packing.train_batch([responses[i] for i in part], prompt_len=T - R,
                                response_len=R, micro_batch=micro, num_micro=M, pad_id=0,
                                aggregation="token_mean", norm_len=R)
    filled.append(int(batch.mask_MxBxR.any(axis=(1, 2)).sum()))
  est = step_lengths.learner_estimate(report, lengths_R)
  assert est["micro_batches"] == filled and max(filled) < M
  assert est["learner_s"] == pytest.approx(
      sum(_seconds(programs["learner_step"], n / M, target) for n in filled), rel=1e-12)
  # The recompute: every response packed at once, scored micro rows a call.
  layout = packing.place([len(prompt)] * rows, lengths_R, T - R, R)
  calls, left = [], layout.num_rows
  while left > 0:
    calls.append(experience._batch_size_for(left, micro))  # pylint: disable=protected-access
    left -= calls[-1]
  assert est["score_calls"] == len(calls) < rows // micro
  assert est["recompute_s"] == pytest.approx(
      sum(_seconds(programs["score"], n / micro, target) for n in calls), rel=1e-12)
  assert est["learner_s"] < report["step_estimate"]["learner_s"]


def test_a_target_without_overlap_adds_compute_and_memory_times():
  """This host's CPU (`targets.this_cpu`) runs fused ops one after another: a program's
  floor is its FLOPs' time plus its bytes' time, in every estimate."""
  from exgrpo_jax.aot import targets  # pylint: disable=g-import-not-at-top
  assert not targets.this_cpu(1e11, 2e10).overlap
  assert targets.get("v5e-8").overlap
  with open(os.path.join(conftest.REPO_ROOT, "docs/results/aot_qwen7b_h100x8.json"),
            encoding="utf-8") as f:
    report = json.load(f)["report"]
  b, programs = report["batch"], {p["name"]: p for p in report["programs"]}
  lengths_R = lengths.scenario("mid", b["response_tokens"], b["questions"] * b["k"])
  overlapped = step_lengths.learner_estimate(report, lengths_R)
  report["target"] = dict(report["target"], overlap=False)
  serial = step_lengths.learner_estimate(report, lengths_R)
  M = int(programs["learner_step"]["purpose"].split(" micro-batches")[0].split()[-1])
  t = report["target"]
  assert serial["learner_s"] == pytest.approx(sum(
      n / M * programs["learner_step"]["flops_per_device"] / t["peak_flops"]
      + analysis.call_bytes(programs["learner_step"]) / t["hbm_bandwidth"]
      for n in serial["micro_batches"]), rel=1e-12)
  assert serial["learner_s"] > overlapped["learner_s"]
  seconds = analysis.bound_s(np.array([2.0, 6.0]), np.array([3.0, 1.0]), t)
  assert seconds == pytest.approx([2 / t["peak_flops"] + 3 / t["hbm_bandwidth"],
                                   6 / t["peak_flops"] + 1 / t["hbm_bandwidth"]])


def test_the_step_table_names_the_largest_part_and_the_measured_efficiency():
  with open(os.path.join(conftest.REPO_ROOT, "docs/results/aot_qwen7b_h200x8.json"),
            encoding="utf-8") as f:
    plan = json.load(f)
  out = step_lengths.step_table([("qwen7b", plan)], mean=3501, cap_share=0.09)
  row = next(l for l in out.splitlines() if l.startswith("| qwen7b | h200x8 | mean 3501"))
  cells = [c.strip() for c in row.strip("|").split("|")]
  rollout, recompute, learner, step = (float(c) for c in (cells[4], cells[5], cells[6],
                                                          cells[8]))
  assert step == pytest.approx(rollout + recompute + learner, abs=1.5)
  assert cells[9] == max(dict(rollout=rollout, recompute=recompute, learner=learner).items(),
                         key=lambda kv: kv[1])[0]
  measured = step_lengths.MEASURED["NVIDIA H200"]
  assert float(cells[10]) == pytest.approx(
      rollout / measured["decode"] + (recompute + learner) / measured["learner"], abs=3)
  assert "one H200, Qwen2.5-1.5B shape, 2026-11-26" in out
  assert step_lengths.at_measured(dict(device_kind="TPU v5e"), 1.0, 1.0) is None


def _plan(name: str) -> dict:
  with open(os.path.join(conftest.REPO_ROOT, f"docs/results/aot_{name}.json"),
            encoding="utf-8") as f:
    return json.load(f)


def test_the_recommended_slots_cost_no_more_and_say_whether_they_were_compiled():
  plan = _plan("qwen7b_v5p-8")
  dists = lengths.distributions(8192, 1024)
  marks = {}
  for label, lengths_R in dists.items():
    admitting = lengths.admitting_estimate(plan, lengths_R, 0.1)
    text = step_lengths.recommended(plan, lengths_R, 0.1, admitting)
    slots, seconds = int(text.split()[0]), float(text.split("(")[1].split()[0])
    assert seconds <= round(admitting["rollout_s"]), label
    assert ("not compiled" in text) == (slots != plan["chosen"]["max_rows"]), label
    marks[label] = slots
  assert marks["long"] > plan["chosen"]["max_rows"]  # the table's recommendation


def test_slots_compiles_the_plans_choice_with_that_many_slots_over_its_pool(monkeypatch):
  from exgrpo_jax.aot import plan as plan_lib  # pylint: disable=g-import-not-at-top
  like = _plan("qwen7b_v5p-8")
  compiled = []

  class _Planner(plan_lib.Planner):
    def compile(self, tensor, micro, max_rows, parts, kv_pages=0):
      compiled.append((tensor, micro, max_rows, parts, kv_pages))
      return dict(like["report"], ok=True, first_failure=None)

  monkeypatch.setattr(plan_lib, "Planner", _Planner)
  result = plan_lib.with_slots("configs/qwen7b.py", "v5p-8", like, 704)
  pages = lengths.row_pages(like["report"]) * like["chosen"]["max_rows"]
  assert compiled == [(4, 8, 704, ("learner", "rollout"), pages)]
  assert result["fits"] and result["chosen"]["max_rows"] == 704
  assert result["chosen"]["kv_pages"] == lengths.capacity_pages(like) == pages
  assert result["verdict"] == ("fits: --config.mesh.shape='(1, 4)' "
                               f"--config.rollout.max_rows=704 --config.rollout.kv_pages={pages}")


def test_the_plans_mid_step_is_one_figure_in_its_json_render_and_estimate(monkeypatch):
  """The plan JSON's `settled[].mid_step_s`, `--render`'s mid step and `--estimate`'s
  admitting mid step are one figure: the step as compiled, every part at the mid lengths."""
  from exgrpo_jax.aot import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import plan_cli  # pylint: disable=g-import-not-at-top
  like = _plan("qwen7b_v5p-8")

  class _Planner(plan_lib.Planner):
    def compile(self, tensor, micro, max_rows, parts, kv_pages=0):
      return dict(like["report"], ok=True, first_failure=None)

  monkeypatch.setattr(plan_lib, "Planner", _Planner)
  monkeypatch.setattr(plan_lib, "pool_bound", lambda report: 0)  # keep the compiled pool
  result = plan_lib.plan("configs/qwen7b.py", "v5p-8", like)
  json_s = result["settled"][0]["mid_step_s"]
  mid = lengths.scenario("mid", 8192, 1024)
  step = step_lengths.plan_step(like, mid, 0.1)
  assert json_s == pytest.approx(step["total_s"], rel=1e-12)
  assert step["learner_s"] < like["report"]["step_estimate"]["learner_s"]  # not at the cap
  row = next(l for l in step_lengths.step_table([("qwen7b", like)]).splitlines()
             if "| mid |" in l)
  assert row.split(" | ")[8] == f"{json_s:.0f}"  # "admitting, step s"
  rendered = next(l for l in plan_cli.render([os.path.join(
      conftest.REPO_ROOT, "docs/results/aot_qwen7b_v5p-8.json")]).splitlines()
                  if l.startswith("| qwen7b | v5p-8 | 528 |"))
  assert rendered.rstrip(" |").split(" | ")[-1] == f"{json_s:.0f}"
