"""scripts/bench/bench_lora.py on a tiny model: its JSON's structure and invariants, and
a bad flag refused in one line. The benchmark's run is slow; the bad flag is not."""

import json
import os
import subprocess
import sys

import jax
import pytest

from tests import conftest

SCRIPT = os.path.join("scripts", "bench", "bench_lora.py")
# configs/tiny.py's model at small shapes: figures that do not depend on size or noise.
SMALL = ("--config=configs/tiny.py", "--repeats=1", "--config.rollout.max_new_tokens=8",
         "--config.optim.mini_batches=1", "--config.train.batch_questions=2",
         "--config.rollout.k=2")


def _run(*flags) -> subprocess.CompletedProcess:
  env = conftest.subprocess_env(**(conftest.FAST_COMPILE if jax.default_backend() == "cpu"
                                   else {}))
  return subprocess.run([sys.executable, SCRIPT, *flags], cwd=conftest.REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=900, check=False)


def _adapter_params(model: dict, rank: int) -> int:
  """A rank-`rank` adapter's parameters on all seven projections: L x r x (in + out)."""
  D, I = model["hidden"], model["intermediate"]
  q, kv = model["heads"] * model["head_dim"], model["kv_heads"] * model["head_dim"]
  per_layer = (D + q) + 2 * (D + kv) + (q + D) + 3 * (D + I)
  return model["layers"] * rank * per_layer


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench_lora") / "bench_lora.json"
  proc = _run(*SMALL, f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  printed = json.loads(proc.stdout)
  assert json.loads(out.read_text()) == printed
  return printed


@pytest.mark.slow  # the benchmark's run (half a minute)
def test_the_json_names_machine_date_config_shapes_and_command(result):
  assert result["jax"] == jax.__version__
  assert result["machine"]["cpu_count"] == os.cpu_count()
  assert result["machine"]["processor"] and result["machine"]["uname"]
  assert result["date_utc"].endswith("Z")
  assert result["config"] == "configs/tiny.py"
  assert result["command"].startswith(" ".join(["python", SCRIPT, *SMALL, "--out="]))
  assert "compile excluded" in result["timing"]
  shapes = result["shapes"]
  assert (shapes["rollout_rows"], shapes["max_new_tokens"], shapes["micro_batches"]) == (4, 8, 1)
  assert set(result["learner"]["runs"]) == set(result["sampler"]["runs"]) == {
      "full", "lora_r1", "lora_r8"}


@pytest.mark.slow  # the benchmark's run (half a minute)
def test_lora_trains_and_stores_a_small_fraction_of_full_fine_tuning(result):
  runs, model = result["learner"]["runs"], result["shapes"]["model"]
  full = runs["full"]
  assert full["trainable_params"] == model["params"]
  assert full["frozen_base_bytes"] == 0
  for rank in (1, 8):
    run = runs[f"lora_r{rank}"]
    assert run["trainable_params"] == _adapter_params(model, rank)
    assert run["trainable_bytes"] == 4 * run["trainable_params"]  # float32 adapters
    assert run["frozen_base_bytes"] == full["trainable_bytes"]
    assert run["trainable_plus_optimizer_bytes"] < 0.01 * full["trainable_plus_optimizer_bytes"]
    # The step's arguments: the frozen base and the adapters' state, not the full state.
    assert (run["frozen_base_bytes"] + run["trainable_plus_optimizer_bytes"]
            <= run["step_program"]["argument_bytes"]
            < full["step_program"]["argument_bytes"])
  for run in runs.values():
    # AdamW: two moments per trainable parameter (and its step counts).
    assert 2 * run["trainable_bytes"] <= run["optimizer_state_bytes"] <= (
        2 * run["trainable_bytes"] + 64)
    # What the step donates and writes back in place: the trainable tree and its state.
    assert run["step_program"]["alias_bytes"] == run["trainable_plus_optimizer_bytes"]
    assert run["step_s"] > 0 and run["step_program"]["temp_bytes"] > 0
  assert (runs["lora_r8"]["trainable_plus_optimizer_bytes"]
          > runs["lora_r1"]["trainable_plus_optimizer_bytes"])


@pytest.mark.slow  # the benchmark's run (half a minute)
def test_the_merge_costs_once_per_generate_call_and_nothing_per_decode_step(result):
  sampler = result["sampler"]
  steps = sampler["decode_steps_per_generate_call"]
  assert steps == result["shapes"]["max_new_tokens"]
  assert "once per generate call" in sampler["path"]
  assert sampler["runs"]["full"]["merge_s"] == 0
  for name in ("lora_r1", "lora_r8"):
    run = sampler["runs"][name]
    assert run["merge_s"] == run["rollout_copy_s"] > 0
    assert run["merge_per_decode_step_s"] == pytest.approx(run["merge_s"] / steps)
    assert run["adapter_cost_per_decode_step_s"] == 0
    assert run["unmerged_adapter_per_decode_step_s"] > 0
    # The merged copy decodes with the program full fine-tuning's copy compiled.
    assert run["decode_programs_compiled"] == 0
  assert sampler["runs"]["full"]["decode_programs_compiled"] > 0
  assert sampler["runs"]["full"]["unmerged_adapter_per_decode_step_s"] == 0


def test_a_bad_flag_is_refused_in_one_line_before_anything_loads(tmp_path):
  out = tmp_path / "bench_lora.json"
  proc = _run("--config=configs/tiny.py", "--ranks=1,0", f"--out={out}")
  assert proc.returncode == 2
  assert proc.stderr.strip() == "bench_lora: --ranks: '0' is not a whole number >= 1"
  assert proc.stdout == "" and not out.exists()
