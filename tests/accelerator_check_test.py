"""scripts/accelerator/accelerator_check.py --smoke end to end on CPU, its budgets and flags,
and the split/join of scripts/accelerator/accelerator_bundle.sh (no download)."""

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

from scripts.accelerator import accelerator_check
from tests import conftest

SCRIPT = os.path.join(conftest.REPO_ROOT, "scripts", "accelerator", "accelerator_check.py")
BUNDLE = os.path.join(conftest.REPO_ROOT, "scripts", "accelerator", "accelerator_bundle.sh")
HAS_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))


def run_check(tmp_path, *args) -> dict:
  out = tmp_path / "check.json"
  env = conftest.subprocess_env()
  proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out), *args],
                        cwd=conftest.REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  return json.loads(out.read_text())


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, smollm2_hf_dir):
  del smollm2_hf_dir  # the tiny models use the embedded SmolLM2's tokenizer
  return run_check(tmp_path_factory.mktemp("smoke"))


@pytest.mark.slow
def test_smoke_runs_every_part(smoke):
  parts = smoke["parts"]
  assert list(parts) == list(accelerator_check.ORDER)
  expected = {name: "ok" for name in parts}
  if not HAS_TORCH:
    expected["parity"] = "skipped"
  assert {n: p["status"] for n, p in parts.items()} == expected, {
      n: p["error"] for n, p in parts.items()}
  assert smoke["ok"] and smoke["environment"]["backend"] == "cpu"
  assert smoke["environment"]["versions"]["jax"]


@pytest.mark.slow
def test_smoke_figures_are_plausible(smoke):
  figures = {name: part["figures"] for name, part in smoke["parts"].items()}
  tests = figures["tests"]
  assert tests["passed"] > 0 and tests["failed"] == tests["errors"] == 0, tests
  if HAS_TORCH:
    rows = figures["parity"]["rows"]
    assert [(r["dtype"], r["matmul_precision"]) for r in rows] == [
        ("float32", "highest"), ("bfloat16", "default"), ("float32", "default")]
    assert [r["within_tolerance"] for r in rows] == [True, True, None], rows  # last: reported
    assert rows[0]["max_abs_logp_diff"] < 1e-3
    assert rows[1]["max_abs_logp_diff"] > rows[0]["max_abs_logp_diff"]
  runs = figures["sampler"]["runs"]
  assert {r["model"] for r in runs} == {"tiny random llama", "tiny random qwen2"}
  for run in runs:
    assert run["ours"]["tokens_per_s"] > 0 and run["hbm_bound_tokens_per_s"] > 0
    if HAS_TORCH:
      assert run["transformers"]["tokens_per_s"] > 0
  (case,) = figures["learner"]["cases"]
  assert case["step_s"] > 0 and case["tokens_per_s"] > 0, case
  assert case["compiled_gib"]["total"] > 0
  assert case["aot_prediction"] is None  # none is made for the CPU
  assert sum(sum(c.values()) for c in tests["per_file"].values()) == tests["passed"]
  assert figures["sampler"]["published_bandwidth_gb_per_s"] is None  # CPU: the measured
  float32, bfloat16 = figures["gap"]["rows"]
  assert (float32["matmul_precision"], bfloat16["matmul_precision"]) == ("highest", "default")
  assert float32["tokens"] == bfloat16["tokens"] > 0
  assert float32["max_abs_delta_logp"] < 1e-3 and float32["fraction_ratio_off_by_1pct"] == 0
  assert bfloat16["mean_abs_delta_logp"] > float32["mean_abs_delta_logp"]
  (step,) = figures["train"]["steps"]
  assert 0 <= step["batch/solved"] <= 1 and step["timing_s/step"] > 0


@pytest.mark.slow
def test_render_gives_one_row_per_part_and_tables(smoke, tmp_path, capsys):
  path = tmp_path / "report.json"
  path.write_text(json.dumps(smoke))
  assert accelerator_check.main(["--render", str(path)]) == 0
  text = capsys.readouterr().out
  for name, part in smoke["parts"].items():
    assert f"| {name} | {part['status']} |" in text
  assert "| attention | S | micro_batches | step_s |" in text  # the learner's cases


def test_an_expired_budget_leaves_measurements_out(tmp_path):
  report = run_check(tmp_path, "--parts", "learner", "--budget", "learner=0")
  assert list(report["parts"]) == ["learner"]
  learner = report["parts"]["learner"]
  assert learner["status"] == "ok" and learner["figures"]["cases"] == []
  assert learner["figures"]["skipped_for_budget"] == ["blockwise S=64"]


@pytest.mark.parametrize("argv, message", [
    (["--budget", "sampler"], "--budget 'sampler': expected PART=SECONDS"),
    (["--parts", "tests,speed"], "--parts: unknown speed"),
])
def test_bad_flags_give_one_line(argv, message):
  with pytest.raises(SystemExit, match=message):
    accelerator_check.main(argv)


def bundle(*args):
  return subprocess.run(["bash", BUNDLE, *args], capture_output=True, text=True)


def test_bundle_split_and_join_round_trip(tmp_path):
  original = tmp_path / "model.whl"
  original.write_bytes(os.urandom(100_003))
  assert bundle("split", str(original), str(tmp_path / "parts"), "2").returncode == 0
  part0, part1 = tmp_path / "parts" / "part0", tmp_path / "parts" / "part1"
  assert sorted(p.name for p in part1.iterdir()) == ["model.whl.1", "model.whl.sha256"]
  assert bundle("join", str(tmp_path / "out"), str(part0), str(part1)).returncode == 0
  assert (tmp_path / "out" / "model.whl").read_bytes() == original.read_bytes()

  damaged = bytearray((part0 / "model.whl.0").read_bytes())
  damaged[7] ^= 1
  (part0 / "model.whl.0").write_bytes(bytes(damaged))
  proc = bundle("join", str(tmp_path / "out2"), str(part0), str(part1))
  assert proc.returncode != 0 and "does not match" in proc.stderr
  proc = bundle("join", str(tmp_path / "out3"), str(part1))  # a part missing
  assert proc.returncode != 0 and "does not match" in proc.stderr


def test_a_raising_part_is_recorded_and_the_next_still_runs():
  from exgrpo_jax import registry  # pylint: disable=g-import-not-at-top
  from scripts.accelerator import accelerator_parts as parts  # pylint: disable=g-import-not-at-top
  table = registry.Registry("part")
  table.register("learner")(lambda ctx, deadline: {}[("missing", "key")])
  table.register("train")(lambda ctx, deadline: dict(summary="ran", failures=["over 1e-3"]))
  runner = types.SimpleNamespace(PARTS=table, Deadline=parts.Deadline, Skip=parts.Skip,
                                 describe=parts.describe)
  records = [accelerator_check.PartRecord(name, 1.0) for name in ("learner", "train")]
  for record in records:
    accelerator_check.run_part(runner, record, ctx=None)
  assert [(r.status, r.error) for r in records] == [
      ("error", "KeyError: ('missing', 'key')"), ("failed", None)]
  learner_row, train_row = accelerator_check.table(records).splitlines()[1:]
  assert "KeyError" in learner_row and train_row.endswith("ran")


def test_compare_sets_the_h200_learner_cases_against_the_aot_predictions():
  from scripts.accelerator import accelerator_speed  # pylint: disable=g-import-not-at-top
  table = accelerator_speed.compare(os.path.join(conftest.REPO_ROOT, "docs", "results",
                                                 "accelerator_check_h200.json"))
  rows = [line for line in table.splitlines() if line.startswith("| cudnn S=4096")]
  assert rows == ["| cudnn S=4096 M=2 | 30.46 | 29.21 | 1.043 | 13.21 | 11.96 | 36.95 |"]


def test_the_hbm_bound_takes_a_known_devices_published_bandwidth(monkeypatch):
  """A sum to one scalar read 539 GB/s on an H200 (published 4,800): the bound divides by
  the published figure where the AOT targets know the device, the measured one elsewhere."""
  from scripts.bench import bench_sampler  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(bench_sampler, "read_bandwidth_gbs", lambda repeats: 539.0)
  for kind, bound in (("NVIDIA H200", 4800.0), ("cpu", 539.0)):
    monkeypatch.setattr(bench_sampler.jax, "devices",
                        lambda kind=kind: [types.SimpleNamespace(device_kind=kind)])
    assert bench_sampler.bound_bandwidth_gbs(5) == dict(
        measured_read_bandwidth_gb_per_s=539.0,
        published_bandwidth_gb_per_s=None if kind == "cpu" else bound,
        bound_bandwidth_gb_per_s=bound)


# The packages of the GPU image scripts/accelerator/accelerator_bundle.sh completes, with
# what JAX and PyTorch install beside them.
IMAGE = {"jax", "flax", "optax", "orbax-checkpoint", "transformers", "torch", "pandas", "sympy",
         "pytest", "pytest-xdist", "numpy", "ml-dtypes", "absl-py", "jinja2"}
# What the device's scripts run, as its image imports them.
ON_DEVICE = ("scripts.accelerator.accelerator_check", "scripts.accelerator.accelerator_speed",
             "scripts.accelerator.gpu_followup", "scripts.accelerator.gpu_lora",
             "exgrpo_jax.training.trainer", "exgrpo_jax.study.runs",
             "exgrpo_jax.study.protocol")


def test_what_runs_on_the_gpu_image_imports_without_the_dependencies_it_lacks():
  """The project's dependencies that neither the image nor the bundle's wheels hold are
  made unimportable; every module the device's scripts run still imports."""
  import re  # pylint: disable=g-import-not-at-top
  import tomllib  # pylint: disable=g-import-not-at-top
  with open(os.path.join(conftest.REPO_ROOT, "pyproject.toml"), "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
  with open(BUNDLE, encoding="utf-8") as f:
    wheels = re.search(r"WHEELS=\((.*?)\)", f.read(), re.S)[1].split()
  name = lambda spec: re.match(r"[A-Za-z0-9_.-]+", spec)[0].lower().replace("_", "-")
  lacking = {name(d) for d in deps} - IMAGE - {name(w) for w in wheels}
  child = f"""
import importlib, importlib.metadata, sys
blocked = {{m for m, dists in importlib.metadata.packages_distributions().items()
           if any(d.lower().replace('_', '-') in {sorted(lacking)!r} for d in dists)}}
class Lacking:
  def find_spec(self, fullname, path=None, target=None):
    if fullname.split('.')[0] in blocked:
      raise ImportError(f'{{fullname}}: not on the GPU image')
sys.meta_path.insert(0, Lacking())
for module in {ON_DEVICE!r}:
  importlib.import_module(module)
"""
  proc = subprocess.run([sys.executable, "-c", child], cwd=conftest.REPO_ROOT,
                        env=conftest.subprocess_env(), capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, f"lacking {sorted(lacking)}: {proc.stderr[-2000:]}"
