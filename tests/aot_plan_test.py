"""The planner's arithmetic (`exgrpo_jax.aot.plan`): the pool's bound on the rows per
call, a decode step's bytes, and the rollout search's choice of rows, on made-up compiler
figures (no compiles); `python -m exgrpo_jax.aot [plan]`'s bad arguments and labels."""

import json
import os
import subprocess
import sys

import pytest

from exgrpo_jax.aot import lengths
from exgrpo_jax.aot import plan
from exgrpo_jax.aot import plan_cli
from tests import conftest

GIB = 2 ** 30


def _report(kv_heads, tensor, devices, prompt_tokens, response_tokens, max_rows, fixed_gib,
            row_bytes, usable_gib, layers=32, dtype="bfloat16"):
  """An AOT report with what `pool_bound` reads: decode_chunk's device peak is `fixed_gib`
  plus `max_rows` rows of `row_bytes`."""
  return dict(
      model=dict(kv_heads=kv_heads, hidden=4096, heads=32, layers=layers, dtype=dtype),
      batch=dict(prompt_tokens=prompt_tokens, response_tokens=response_tokens,
                 max_rows=max_rows),
      mesh=dict(fsdp=devices // tensor, tensor=tensor), devices=devices,
      programs=[dict(name="learner_step", device_peak_bytes=50 * GIB),
                dict(name="decode_chunk",
                     device_peak_bytes=fixed_gib * GIB + max_rows * row_bytes,
                     usable_bytes=usable_gib * GIB)])


def test_pool_bound_is_the_room_left_over_a_full_rows_kv_bytes():
  # Llama-3.1-8B on a v5p-8 at 1 x 4: 8 KV heads, 2 per device, of 128; 1024 + 8192 tokens
  # (144 pages of 64); keys and values in bfloat16 over 32 layers, all rows on each device.
  row = 9216 * 2 * 2 * 128 * 2 * 32
  report = _report(8, 4, 4, 1024, 8192, 192, 28.0, row, 95.73)
  assert plan.pool_bound(report) == pytest.approx((95.73 - 28.0) * GIB / row)
  assert plan.pool_bound(report) == pytest.approx(240.8, abs=0.1)


def test_pool_bound_splits_rows_over_the_batch_axes_and_kv_heads_only_where_they_divide():
  # 4 KV heads on tensor 8 stay whole on each device; rows split over fsdp 2 (16 devices).
  row = 9216 * 2 * 4 * 128 * 2 * 32 / 2
  report = _report(4, 8, 16, 1024, 8192, 512, 10.0, row, 31.24)
  assert plan.pool_bound(report) == pytest.approx((31.24 - 10.0) * GIB / row)


def test_pool_bound_counts_a_rows_last_page_whole():
  # A 1000-token prompt takes the 1024 bucket; 1024 + 8200 tokens fill 145 pages of 64.
  row = 145 * 64 * 2 * 2 * 128 * 2 * 32
  report = _report(8, 4, 4, 1000, 8200, 64, 20.0, row, 95.73)
  assert plan.pool_bound(report) == pytest.approx((95.73 - 20.0) * GIB / row)


def test_pool_bound_prices_the_kv_in_the_models_compute_dtype():
  # A float32 model's pool holds 4-byte keys and values: a row costs twice bfloat16's.
  row = 9216 * 2 * 2 * 128 * 4 * 32
  report = _report(8, 4, 4, 1024, 8192, 96, 28.0, row, 95.73, dtype="float32")
  assert plan.pool_bound(report) == pytest.approx((95.73 - 28.0) * GIB / row)


def test_decode_step_bytes_are_the_rooflines_reads_less_arguments_and_outputs_per_step():
  decode = dict(name="decode_chunk", purpose="16 decode steps of 224 slots over the "
                "32256-page pool", argument_bytes=60 * GIB, output_bytes=55 * GIB,
                hbm_bytes_per_call=(60 + 55 + 16 * 38.5) * GIB)
  assert plan_cli.decode_step_bytes(dict(programs=[decode])) == 38.5 * GIB


def test_prefill_seconds_are_admit_and_place_rooflines_times_their_calls():
  programs = [dict(name="admit", roofline_s=0.03, calls_per_step=32),
              dict(name="place", roofline_s=0.05, calls_per_step=64),
              dict(name="decode_chunk", roofline_s=0.29, calls_per_step=2000)]
  assert plan_cli.prefill_seconds(dict(programs=programs)) == pytest.approx(0.96 + 3.2)


class _AffinePlanner(plan.Planner):
  """A planner whose compiles are made up: each rollout program's peak is affine in the
  rows, and a compile fits where every peak is within `usable`."""

  def __init__(self, usable, slopes, fixed):  # pylint: disable=super-init-not-called
    self.usable, self.slopes, self.fixed, self.search = usable, slopes, fixed, []
    self.ceiling, self.skipped = usable, []

  def compile(self, tensor, micro, max_rows, parts):
    peaks = {name: self.fixed[name] + slope * max_rows for name, slope in self.slopes.items()}
    self.search.append(max_rows)
    return dict(ok=max(peaks.values()) <= self.usable, first_failure=None,
                programs=[dict(name=n, error=None, device_peak_bytes=v * GIB)
                          for n, v in peaks.items()])


def test_rollout_search_takes_the_largest_multiple_of_the_unit_between_steps_of_64():
  # Llama-3.1-8B's figures on a v5p-8 at 1 x 4 while the kernel's pool still grew:
  # repage_layer binds at 222.8 rows.
  planner = _AffinePlanner(95.73, dict(repage_layer=0.2978, decode_chunk=0.2813),
                           dict(repage_layer=29.4, decode_chunk=28.67))
  assert planner.rollout(4, 1024, 8) == 216
  assert 224 in planner.search and 216 in planner.search
  assert len(planner.search) == len(set(planner.search))  # no compile twice


def test_rollout_search_keeps_a_multiple_of_64_that_is_the_most_and_all_rows():
  assert _AffinePlanner(95.73, dict(decode_chunk=0.05), dict(decode_chunk=20.0)).rollout(
      2, 1024, 8) == 1024
  planner = _AffinePlanner(10.0, dict(place=1 / 32), dict(place=2.0))  # 256 rows exactly
  assert planner.rollout(1, 1024, 16) == 256
  assert planner.search[-1] == 272  # the next multiple of the unit shown not to fit


def test_rollout_search_gives_0_where_64_rows_do_not_fit():
  assert _AffinePlanner(10.0, dict(admit=0.1), dict(admit=9.0)).rollout(1, 1024, 8) == 0


class _PoolPlanner(plan.Planner):
  """A planner whose compiles fit while the pool has at most `fits` pages: above, the
  decode's peak exceeds the usable memory by the extra pages' bytes."""

  def __init__(self, usable, fits, page_bytes, shards):  # pylint: disable=super-init-not-called
    self.usable, self.fits, self.page_bytes, self.shards = usable, fits, page_bytes, shards
    self.ceiling, self.search, self.skipped = usable, [], []

  def compile(self, tensor, micro, max_rows, parts, kv_pages=0):
    self.search.append((max_rows, kv_pages))
    over = max(kv_pages - self.fits, 0) / self.shards * self.page_bytes
    return dict(ok=not over, first_failure=None, programs=[dict(
        name="decode_chunk", error=None, device_peak_bytes=self.usable * GIB + over,
        usable_bytes=self.usable * GIB)])


def test_admission_takes_the_pages_that_fit_and_the_slots_that_cost_least_over_them():
  # qwen7b on v5e-16, compiled with 64 rows reserved at their longest: the memory holds
  # about 67 rows' pages; a made-up compiler fits 9,400 of them.
  with open(os.path.join(conftest.REPO_ROOT, "tests/data/aot_qwen7b_v5e-16_reserved.json")) as f:
    reserved = json.load(f)["report"]
  shards, page_bytes = lengths.kv_layout(reserved)
  planner = _PoolPlanner(reserved["programs"][0]["usable_bytes"] / GIB, 9400, page_bytes,
                         shards)
  best = dict(tensor=4, micro_batch_size=8, max_rows=64)
  report, slots, pages = planner.admission(best, reserved, 0.1)
  first = int(plan.pool_bound(reserved) * 144) // shards * shards
  assert planner.search[0][1] == first > 9400  # too many: lowered once
  assert len(planner.search) == 2 and planner.search[1] == (slots, pages) and report["ok"]
  assert 9400 - 2 * shards <= pages <= 9400 and slots > 64
  mid = lengths.scenario("mid", 8192, 1024)
  assert (lengths.rollout_estimate(reserved, mid, slots=slots, capacity=pages,
                                   headroom=0.1)["rollout_s"]
          < lengths.rollout_estimate(reserved, mid)["rollout_s"])


class _SmallPlanner(_PoolPlanner):
  """`_PoolPlanner` whose compiles are whole reports (`reserved`'s shapes), a pool of 0
  pages being every slot's row at its longest."""

  def __init__(self, reserved, fits):  # pylint: disable=super-init-not-called
    shards, page_bytes = lengths.kv_layout(reserved)
    super().__init__(reserved["programs"][0]["usable_bytes"] / GIB, fits, page_bytes, shards)
    self.reserved, self.per_row = reserved, lengths.row_pages(reserved)

  def compile(self, tensor, micro, max_rows, parts, kv_pages=0):
    pages = kv_pages or self.per_row * max_rows // self.shards * self.shards
    return dict(self.reserved, **super().compile(tensor, micro, max_rows, parts, pages))


def test_where_64_reserved_rows_do_not_fit_64_slots_take_the_largest_pool_that_does():
  with open(os.path.join(conftest.REPO_ROOT, "tests/data/aot_qwen7b_v5e-16_reserved.json")) as f:
    reserved = json.load(f)["report"]
  planner = _SmallPlanner(reserved, fits=3000)  # about 20 rows' pages of 64 x 144
  report, pages, rows = planner.bounded(4, 8)
  assert rows == pages // 144 < 64
  assert report["ok"] and planner.search[0] == (64, 64 * 144 // planner.shards * planner.shards)
  assert 3000 - 2 * planner.shards <= pages <= 3000 and pages % planner.shards == 0
  assert planner.search[-1] == (64, pages) and len(planner.search) == 2
  assert _SmallPlanner(reserved, fits=100).bounded(4, 8) is None  # not one row's pages


@pytest.mark.parametrize("args, line", [
    (["--render", "{tmp}/notjson.json"],
     "--render {tmp}/notjson.json: not a JSON file (Expecting value: line 1 column 1 "
     "(char 0))"),
    (["--render", "{tmp}/nothing*.json"], "--render {tmp}/nothing*.json: no such file"),
    (["--render", "{tmp}/list.json"],
     "--render {tmp}/list.json: not a plan (a JSON object written by this script)"),
    (["--render", "{tmp}/other.json"],
     "--render: none of {tmp}/other.json is a plan (written by `exgrpo_jax.aot plan --out`)"),
    # Another tool's JSON, even one with a 'config' key (a study report), is no plan.
    (["--render", "{repo}/docs/results/study_lora.json", "{repo}/docs/results/bench_lora.json"],
     "--render: none of {repo}/docs/results/study_lora.json, "
     "{repo}/docs/results/bench_lora.json is a plan (written by `exgrpo_jax.aot plan --out`)"),
    (["--config=configs/qwen7b_lora.py", "--target=v4-8", "--out={tmp}/o.json",
      "--like={repo}/docs/results/bench_lora.json"],
     "--like {repo}/docs/results/bench_lora.json: not a plan (written by "
     "`exgrpo_jax.aot plan --out`)"),
    # --like never hands on a verdict it did not compile: a plan that fits nothing has
    # no settings to compile, and another target's settings are taken only when asked.
    (["--config=configs/qwen7b_lora.py", "--target=v4-8", "--out={tmp}/o.json",
      "--like={repo}/docs/results/aot_qwen7b_v4-8.json"],
     "--like {repo}/docs/results/aot_qwen7b_v4-8.json: qwen7b fits nothing on v4-8, so it "
     "has no settings to compile; search without --like"),
    (["--config=configs/qwen7b_lora.py", "--target=v4-8", "--out={tmp}/o.json",
      "--like={repo}/docs/results/aot_qwen7b_v5p-8.json"],
     "--like {repo}/docs/results/aot_qwen7b_v5p-8.json: a plan for v5p-8, not v4-8 "
     "(--like-any takes its settings anyway)"),
    (["--config=configs/qwen7b.py", "--target=v5p-8", "--out={tmp}/o.json", "--like-any"],
     "--like-any is read only with --like PLAN"),
    (["--reprice", "{repo}/docs/results/bench_lora.json"],
     "--reprice {repo}/docs/results/bench_lora.json: not a plan (written by "
     "`exgrpo_jax.aot plan --out`)"),
    (["--reprice", "{tmp}/nothing*.json"], "--reprice {tmp}/nothing*.json: no such file"),
    (["--reprice", "{tmp}/plan.json", "--target=v5p-8"],
     "--target searches; --reprice only reprices plans: give one or the other"),
    (["--config=configs/nosuch.py", "--target=v5p-8", "--out={tmp}/o.json"],
     "--config=configs/nosuch.py: no such file"),
    (["--config=configs/tiny.py", "--target=v5p-8", "--out={tmp}/o.json",
      "--like={tmp}/missing.json"], "--like {tmp}/missing.json: No such file or directory"),
    # Flags the chosen mode would not read are refused, not ignored.
    (["--render", "{tmp}/plan.json", "--mean", "3501"],
     "--mean is read only with --estimate"),
    (["--render", "{tmp}/plan.json", "--cap-share", "0.09"],
     "--cap-share is read only with --estimate"),
    (["--render", "{tmp}/plan.json", "--lengths", "{tmp}/lengths.json"],
     "--lengths is read only with --estimate"),
    (["--render", "{tmp}/plan.json", "--estimate", "--cap-share", "0.09"],
     "--cap-share is read only with --mean"),
    (["--render", "{tmp}/plan.json", "--estimate", "--mean", "3501", "--lengths",
      "{tmp}/lengths.json"], "--lengths and --mean are two length distributions: give one"),
    (["--render", "{tmp}/plan.json", "--target=v5p-8"],
     "--target searches; --render only renders plans: give one or the other"),
    (["--config=configs/tiny.py", "--target=v5p-8", "--out={tmp}/o.json", "--estimate"],
     "--estimate is read only with --render FILES"),
    # --slots compiles a fitting plan's choice with other slots.
    (["--config=configs/qwen7b.py", "--target=v5p-8", "--out={tmp}/o.json", "--slots", "704"],
     "--slots 704: needs --like a plan that fits (and no --meshes)"),
    (["--render", "{tmp}/plan.json", "--slots", "704"],
     "--slots searches; --render only renders plans: give one or the other"),
    (["--config=configs/qwen7b.py", "--target=v5p-8", "--out={tmp}/o.json", "--slots", "0",
      "--like={repo}/docs/results/aot_qwen7b_v5p-8.json"],
     "argument --slots: must be at least 1, got 0"),
])
def test_a_bad_argument_is_one_line_naming_it(tmp_path, capsys, args, line):
  (tmp_path / "notjson.json").write_text("nope")
  (tmp_path / "list.json").write_text("[1]")
  (tmp_path / "other.json").write_text('{"benchmark": 1}')
  fill = lambda s: s.format(tmp=tmp_path, repo=conftest.REPO_ROOT)
  with pytest.raises(SystemExit) as e:
    plan_cli.main([fill(a) for a in args])
  assert e.value.code == 2
  assert capsys.readouterr().err.splitlines()[-1] == (
      f"exgrpo_jax.aot plan: error: {fill(line)}")


def test_the_planner_is_a_subcommand_of_the_aot_module(tmp_path):
  plan_path = os.path.join(conftest.REPO_ROOT, "docs/results/aot_qwen7b_h100x8.json")
  proc = subprocess.run(
      [sys.executable, "-m", "exgrpo_jax.aot", "plan", "--render", plan_path],
      capture_output=True, text=True, check=False, cwd=tmp_path,
      env=conftest.subprocess_env())
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "| qwen7b | h100x8 | 2 x 4 |" in proc.stdout
  proc = subprocess.run(
      [sys.executable, "-m", "exgrpo_jax.aot", "plan", "--render", plan_path, "--mean", "9"],
      capture_output=True, text=True, check=False, cwd=tmp_path,
      env=conftest.subprocess_env())
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1] == (
      "exgrpo_jax.aot plan: error: --mean is read only with --estimate")


class _NothingFits(plan.Planner):
  """A planner whose every compile fails for want of memory."""

  def __init__(self, spec, target):  # pylint: disable=super-init-not-called
    from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
    self.check, self.spec_path, self.target = check, spec, target
    self.name = plan.config_name(spec)
    self.spec, self.usable, self.search = plan.targets.get(target), 15.75, []
    self.margin, self.ceiling, self.skipped = 0.0, 15.75, []

  def compile(self, tensor, micro, max_rows, parts, kv_pages=0):
    failure = f"learner_step did not compile: CompileTimeHbmOom: {40 - tensor} GiB needed"
    self.search.append(dict(tensor=tensor, micro_batch_size=micro, max_rows=max_rows,
                            first_failure=failure))
    return dict(ok=False, first_failure=failure, programs=[])


def test_a_search_that_finds_nothing_exits_1_naming_the_least_failure(tmp_path, capsys,
                                                                      monkeypatch):
  monkeypatch.setattr(plan, "Planner", _NothingFits)
  monkeypatch.setattr(plan_cli.targets, "prepare_environment", lambda: None)
  out = tmp_path / "plan.json"
  code = plan_cli.main(["--config=configs/qwen7b.py", "--target=v5e-8", f"--out={out}"])
  assert code == 1
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert err.startswith("exgrpo_jax.aot plan: qwen7b does not fit v5e-8 at any mesh or "
                        "micro-batch; the least: mesh 2 x 4")
  assert "36 GiB needed" in err and f"(the plan: {out})" in err
  saved = json.loads(out.read_text())
  assert saved["fits"] is False and saved["verdict"] in err


def test_aot_cli_names_an_unreadable_target_config(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "exgrpo_jax.aot", "--config=configs/tiny.py", "--target=h100x8",
       f"--target_config={tmp_path}/h100.pbtxt"],
      capture_output=True, text=True, check=False, cwd=conftest.REPO_ROOT)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1] == (
      f"exgrpo_jax.aot: --target_config={tmp_path}/h100.pbtxt: No such file or directory")


def test_like_refuses_a_plan_of_a_model_of_other_shapes(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(plan_cli.targets, "prepare_environment", lambda: None)
  like = os.path.join(conftest.REPO_ROOT, "docs/results/aot_llama8b_lora_h100x1.json")
  code = plan_cli.main(["--config=configs/qwen7b_lora.py", "--target=h100x1",
                        f"--out={tmp_path}/o.json", f"--like={like}"])
  assert code == 2
  assert capsys.readouterr().err.strip().splitlines()[-1] == (
      f"exgrpo_jax.aot plan: --like {like}: a plan of a model of other shapes: layers 32 "
      "(here 28), hidden 4096 (here 3584), heads 32 (here 28), kv_heads 8 (here 4), vocab "
      "128256 (here 152064) "
      "(--like-any takes its settings anyway)")
  assert not (tmp_path / "o.json").exists()


class _MarginPlanner(_AffinePlanner):
  """`_AffinePlanner` whose compiles are judged as the check judges them
  (`analysis.Result.fits`): within the usable memory less the target's margin."""

  def __init__(self, usable, margin, slopes, fixed):  # pylint: disable=super-init-not-called
    super().__init__(usable, slopes, fixed)
    self.margin, self.ceiling = margin, usable - margin

  def compile(self, tensor, micro, max_rows, parts):
    from exgrpo_jax.aot import analysis  # pylint: disable=g-import-not-at-top
    self.search.append(max_rows)
    results = [analysis.Result(name, "", peak_bytes=int((self.fixed[name] + s * max_rows)
                                                          * GIB),
                               usable_bytes=int(self.usable * GIB),
                               margin_bytes=int(self.margin * GIB))
               for name, s in self.slopes.items()]
    return dict(ok=all(r.fits for r in results), first_failure=None,
                programs=[dict(name=r.name, error=None,
                               device_peak_bytes=r.device_peak_bytes) for r in results])


def test_rows_that_fit_only_inside_the_margin_are_never_chosen():
  # An H100 at 0.95 of its memory (75.15 GiB) less the GPU margin (5%): 71.39 GiB.
  usable = 75.15
  margin = usable * plan.targets.MARGIN["cuda"]
  planner = _MarginPlanner(usable, margin, dict(decode_chunk=0.25), dict(decode_chunk=20.0))
  rows = planner.rollout(1, 1024, 8)
  assert 20.0 + 0.25 * rows <= usable - margin < 20.0 + 0.25 * (rows + 8)
  assert 20.0 + 0.25 * (rows + 8) <= usable  # the next count fits only without margin
  assert rows == 200


def test_a_program_inside_the_margin_is_reported_as_fitting_only_without_it():
  from exgrpo_jax.aot import analysis  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
  result = analysis.Result("repage_layer", "", peak_bytes=int(73 * GIB),
                           usable_bytes=int(75.15 * GIB), margin_bytes=int(3.76 * GIB))
  assert not result.fits and result.fits_without_margin
  assert check.failure_line(result) == (
      "repage_layer fits only without margin: 73.00 GiB per device (its peak 73.00 + 0.00 "
      "kept beside it) > 71.39 GiB (usable 75.15 less the margin of 3.76)")
  result.peak_bytes = int(76 * GIB)
  assert not result.fits and not result.fits_without_margin
  assert check.failure_line(result).startswith("repage_layer does not fit: 76.00 GiB")


class _CopyFails(_AffinePlanner):
  """A rollout whose weights' copy fails at every row count (it does not depend on them)."""

  def compile(self, tensor, micro, max_rows, parts):
    self.search.append(max_rows)
    return dict(ok=False, first_failure="rollout_copy does not fit: 15.77 GiB per device",
                programs=[dict(name="rollout_copy", error=None,
                               device_peak_bytes=15.77 * GIB)])


def test_a_failure_at_the_fewest_rows_ends_the_rollout_search_in_one_compile():
  planner = _CopyFails(15.75, {}, {})
  assert planner.rollout(2, 1024, 8) == 0
  assert planner.search == [64]
  assert planner.skipped == [dict(tensor=2, reason="rollout at 64 rows: rollout_copy does "
                                  "not fit: 15.77 GiB per device", compiles=127)]


class _SilentOom(_AffinePlanner):
  """Affine peaks, but a program over the memory fails to compile with an error that
  does not say how much it needed, so the first guess is no help."""

  def compile(self, tensor, micro, max_rows, parts):
    result = super().compile(tensor, micro, max_rows, parts)
    for p in result["programs"]:
      if p["device_peak_bytes"] > self.usable * GIB:
        p["error"] = "XlaRuntimeError: RESOURCE_EXHAUSTED"
    return result


def test_the_rollout_search_bisects_instead_of_walking_down():
  # qwen7b_lora on a v5e-8 at 1 x 4: `empty` grows 0.062 GiB a row, 152 rows fit.
  planner = _SilentOom(15.75, dict(empty=0.062), dict(empty=6.3))
  assert planner.rollout(4, 1024, 8) == 152
  assert len(planner.search) <= 10  # a walk down from 1,024 in steps of 64 took 16
  assert len(planner.search) == len(set(planner.search))


class _SourcePlanner(_PoolPlanner):
  """Compiles that are `source`'s programs at the slots and pool asked for (0 pages:
  every slot's row at its longest), the decode's peak growing with the pool and at the
  usable memory at `fits` pages: the pool's bound, and what fits."""

  def __init__(self, source, fits):  # pylint: disable=super-init-not-called
    from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
    shards, page_bytes = lengths.kv_layout(source)
    super().__init__(source["programs"][0]["usable_bytes"] / GIB, fits, page_bytes, shards)
    self.source, self.check = source, check

  def compile(self, tensor, micro, max_rows, parts, kv_pages=0):
    self.search.append((max_rows, kv_pages))
    pool = kv_pages or lengths.row_pages(self.source) * max_rows // self.shards * self.shards
    peak = self.usable * GIB + (pool - self.fits) / self.shards * self.page_bytes
    ok = pool <= self.fits
    batch = dict(self.source["batch"], max_rows=max_rows, kv_pages=kv_pages)
    return dict(self.source, batch=batch, ok=ok, programs=[
        dict(p, fits=ok, device_peak_bytes=peak, usable_bytes=self.usable * GIB)
        if p["name"] == "decode_chunk" else p for p in self.source["programs"]])


def test_like_lowers_a_pool_that_fits_only_without_margin_until_it_fits():
  """`plan --like` of a plan whose pool no longer fits (a margin kept now) compiles its
  choice, then lowers the pool by what the costliest program lacked, re-choosing the
  slots over it: a verdict compiled for this config, never the old plan's."""
  with open(os.path.join(conftest.REPO_ROOT, "tests/data/aot_qwen7b_v5e-16_reserved.json")) as f:
    reserved = json.load(f)["report"]
  planner = _SourcePlanner(reserved, fits=3000)
  like = dict(chosen=dict(tensor=4, micro_batch_size=8, max_rows=64, kv_pages=4000),
              report=reserved)
  report, best = planner.like(like, 0.1)
  assert planner.search[0] == (64, 4000) and report["ok"]
  assert 3000 - 2 * planner.shards <= best["kv_pages"] <= 3000
  assert planner.search[-1] == (best["max_rows"], best["kv_pages"])
  assert len(planner.search) == 2  # the lacking pages are known from the first compile


def _before(name: str) -> dict:
  with open(os.path.join(conftest.REPO_ROOT, f"tests/data/aot_{name}.json")) as f:
    return json.load(f)


def test_like_of_its_own_plan_re_chooses_slots_a_new_pricing_makes_cheaper():
  """A plan re-admitted by `plan --like` of itself, its pool fitting as it is, moves its
  slots to the count the current prices choose from its reserved rows, fewer ones too
  (qwen7b on v5e-16: 1,024 slots cost more at the mid lengths than a few hundred once
  each decode step prices every slot's query block), compiled; where they are its own
  slots, nothing more is compiled."""
  before = _before("qwen7b_v5e-16_1024_slots")
  source, pages = before["report"], before["chosen"]["kv_pages"]
  planner = _SourcePlanner(source, pages)
  mid = lengths.scenario("mid", 8192, 1024)
  at = lambda slots: lengths.rollout_estimate(source, mid, slots=slots, capacity=pages,
                                              headroom=0.1)["rollout_s"]
  report, best = planner.like(before, 0.1)
  assert report["ok"] and 64 <= best["max_rows"] < 1024 and best["kv_pages"] == pages
  assert planner.search == [(1024, pages), (best["max_rows"], pages)]
  assert at(best["max_rows"]) < at(1024)
  planner.search.clear()
  _, same = planner.like(dict(before, chosen=best), 0.1)
  assert same == best and planner.search == [(best["max_rows"], pages)]


def test_like_of_its_own_plan_keeps_the_reserved_rows_where_they_cost_least():
  """qwen7b_lora on v5e-8, 640 slots over 21,214 pages, the memory holding 160 rows at
  their longest: its 152 reserved rows now cost least at the mid lengths, so the plan
  becomes them, each row's pages at its longest (no `kv_pages`, as a search that finds
  so writes it), not 152 slots over a pool larger than they can use."""
  before = _before("qwen7b_lora_v5e-8_640_slots")
  planner = _SourcePlanner(before["report"], 23110)  # 160 rows at their longest
  report, best = planner.like(before, 0.1)
  assert report["ok"] and planner.search == [(640, 21214), (152, 0)]
  assert (best["max_rows"], best["kv_pages"], best["reserved_rows"]) == (152, 0, 152)
  assert "kv_pages" not in plan._flags(8, best, plan.config_cli.load(
      os.path.join(conftest.REPO_ROOT, "configs/qwen7b_lora.py")))


def test_a_batch_of_fewer_rows_than_a_search_step_is_one_call_or_none():
  planner = _AffinePlanner(20.0, dict(generate=0.1), dict(generate=10.0))
  assert planner.rollout(1, 16, 4) == 16 and planner.search == [16]
  assert _AffinePlanner(1.0, dict(generate=0.1), dict(generate=10.0)).rollout(1, 16, 4) == 0


def test_each_compile_of_a_search_releases_what_it_left_on_the_host(monkeypatch):
  """A search's compiles each leave 4-5 GB on the host for a 7B program unless JAX's
  caches are cleared and the freed heap handed back: the planner does both after each."""
  import jax  # pylint: disable=g-import-not-at-top
  square = jax.jit(lambda x: x * x)
  square(1.0)
  assert square._cache_size() == 1  # pylint: disable=protected-access
  plan.release_host_memory()
  assert square._cache_size() == 0  # pylint: disable=protected-access

  released = []
  monkeypatch.setattr(plan, "release_host_memory", lambda: released.append(True))
  monkeypatch.setattr(plan, "configured", lambda *args: None)
  planner = plan.Planner.__new__(plan.Planner)
  planner.spec_path, planner.name, planner.target, planner.search = "c.py", "c", "v4-8", []
  planner.spec = type("Spec", (), {"devices": 4})
  planner.check = type("Check", (), {"run": staticmethod(
      lambda *a, **k: dict(ok=True, first_failure=None, programs=[]))})
  for rows in (64, 128):
    planner.compile(4, 1, rows, ("rollout",))
  assert released == [True, True]
