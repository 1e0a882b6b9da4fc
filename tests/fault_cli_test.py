"""Bad inputs to the command-line tools and faults during export: each ends in one line
naming what is wrong (exit 1, or 2 for bad arguments) or in a complete export.

In-process calls of `main` on a tiny random model with the real tokenizer; the trainer's
guards (stop signals, non-finite stop, metrics after a resume) at library level.
"""

import errno
import json
import os
import signal
import struct

import jax
import numpy as np
import pytest

from exgrpo_jax import cli
from exgrpo_jax import convert
from exgrpo_jax import eval as eval_cli
from exgrpo_jax import generate
from exgrpo_jax import models
from exgrpo_jax.models import export
from exgrpo_jax.models import safetensors_io
from exgrpo_jax.aot import plan_cli
from exgrpo_jax.training import run_guard
from exgrpo_jax.training import run_log
from scripts.bench import bench_admission
from tests.sampling_cli_test import tiny_dir  # pylint: disable=unused-import

TINY = models.ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, eos_token_id=(2,),
                          max_position_embeddings=256)


def _random_params(cfg):
  """Numpy weights (no jitted init: these tests only need something to write)."""
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda s: (rng.normal(size=s.shape) * 0.02).astype(s.dtype),
                      models.abstract_params(cfg))


def _one_error_line(capsys, expected: str, prefix: str = "error: "):
  err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert err and err[-1].startswith(prefix) and expected in err[-1], err
  assert not any("Traceback" in l for l in err), err


# --- export ------------------------------------------------------------------------------

def test_export_is_atomic_and_a_failed_one_leaves_the_previous(tmp_path, monkeypatch):
  dst = str(tmp_path / "hf")
  params = _random_params(TINY)
  export.save_pretrained(TINY, params, dst, info={"step": 1})
  assert export.is_complete(dst, {"step": 1}) and not export.is_complete(dst, {"step": 2})

  def disk_full(tensors, path, metadata=None):
    del tensors, metadata
    with open(path, "wb") as f:
      f.write(b"\0" * 100)
    raise OSError(errno.ENOSPC, "No space left on device", path)

  monkeypatch.setattr(export.safetensors_io, "save_file", disk_full)
  with pytest.raises(OSError, match="No space left"):
    export.save_pretrained(TINY, params, dst, info={"step": 2})
  assert export.is_complete(dst, {"step": 1})
  assert sorted(os.listdir(tmp_path)) == ["hf"]  # no temporary directory left behind


def test_export_killed_midway_is_redone_and_its_leftovers_removed(tmp_path):
  dst = str(tmp_path / "hf")
  stale = tmp_path / ".hf.tmp-999999999"  # a dead pid's temporary directory
  stale.mkdir()
  (stale / "model.safetensors.tmp").write_bytes(b"\0" * 10)
  assert not export.is_complete(dst, {"step": 3})
  export.save_pretrained(TINY, _random_params(TINY), dst,
                         info={"step": 3})
  assert export.is_complete(dst, {"step": 3})
  assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_export_refuses_to_replace_a_directory_that_is_not_a_model(tmp_path):
  (tmp_path / "notes.txt").write_text("mine")
  with pytest.raises(FileExistsError, match="not a model directory"):
    export.save_pretrained(TINY, _random_params(TINY), str(tmp_path))
  assert (tmp_path / "notes.txt").read_text() == "mine"


# --- safetensors and convert --------------------------------------------------------------

def _safetensors(path, n=1000):
  safetensors_io.save_file({"w": np.arange(n, dtype=np.float32)}, str(path))
  return str(path)


def test_truncated_safetensors_is_one_line(tmp_path, capsys):
  path = _safetensors(tmp_path / "model.safetensors")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 100)
  with pytest.raises(ValueError, match=r"tensor w ends at byte \d+ of a \d+-byte file"):
    safetensors_io.SafetensorsFile(path)
  (tmp_path / "config.json").write_text(json.dumps(models.config.to_hf_config(TINY)))
  assert convert.main(["--src", str(tmp_path), "--dst", str(tmp_path / "out")]) == 1
  _one_error_line(capsys, "(truncated)")


def test_huge_safetensors_header_is_one_line(tmp_path):
  path = _safetensors(tmp_path / "model.safetensors")
  with open(path, "r+b") as f:
    f.write(struct.pack("<Q", 2**62))
  with pytest.raises(ValueError, match=r"header length 4611686018427387904 exceeds"):
    safetensors_io.SafetensorsFile(path)


def test_convert_damaged_workdir_is_one_line(tmp_path, capsys):
  os.makedirs(tmp_path / "checkpoints" / "3" / "meta")
  os.makedirs(tmp_path / "checkpoints" / "3" / "params")
  assert convert.main(["--src", str(tmp_path), "--dst", str(tmp_path / "out")]) == 1
  _one_error_line(capsys, "no intact checkpoint")


# --- eval and generate ---------------------------------------------------------------------

@pytest.mark.parametrize("flag, value, why", [
    ("--limit", "-1", "--limit: must be at least 0, got -1"),
    ("--max-prompt-tokens", "-3", "--max-prompt-tokens/--max_prompt_tokens: must be at "
                                  "least 0, got -3")])
def test_eval_negative_counts_are_usage_errors(flag, value, why, capsys):
  with pytest.raises(SystemExit) as e:
    eval_cli.main(["--data", "arithmetic", flag, value])
  assert e.value.code == cli.EXIT_USAGE
  assert capsys.readouterr().err.splitlines()[-1] == (
      f"python -m exgrpo_jax.eval: error: argument {why}")


def test_a_file_that_is_not_gguf_is_named(tmp_path, capsys):
  fake = tmp_path / "model.gguf"
  fake.write_bytes(b"<html>not a model</html>")
  assert generate.main(["--model", str(fake), "--prompt", "Hi"]) == 1
  _one_error_line(capsys, f"{fake}: not a GGUF file (it starts with b'<htm', a GGUF file "
                          "with b'GGUF')")


def test_convert_of_a_workdir_without_a_checkpoint_says_so(tmp_path, capsys):
  os.makedirs(tmp_path / "checkpoints")
  assert convert.main(["--src", str(tmp_path), "--dst", str(tmp_path / "out")]) == 1
  _one_error_line(capsys, "a training workdir whose checkpoints/ holds no checkpoint")


@pytest.mark.parametrize("flag", ["--batch-prompts", "--n"])
def test_eval_zero_counts_are_usage_errors(flag, capsys):
  with pytest.raises(SystemExit) as e:
    eval_cli.main(["--data", "x.jsonl", flag, "0"])
  assert e.value.code == cli.EXIT_USAGE
  _one_error_line(capsys, "must be at least 1, got 0",
                  prefix=f"python -m exgrpo_jax.eval: error: argument {flag}")


@pytest.mark.parametrize("flag, value, why", [
    ("--headroom", "1.5", "must be a share in [0, 1), got 1.5"),
    ("--rows", "0", "must be at least 1, got 0"),
    ("--repeats", "0", "must be at least 1, got 0"),
])
def test_bench_admission_bad_numbers_are_refused_before_the_model_loads(
    flag, value, why, capsys, monkeypatch):
  monkeypatch.setattr(bench_admission.models, "from_pretrained", _no_model_load)
  with pytest.raises(SystemExit) as e:
    bench_admission.main([flag, value])
  assert e.value.code == cli.EXIT_USAGE
  assert capsys.readouterr().err.splitlines()[-1].endswith(
      f": error: argument {flag}: {why}")


def _no_model_load(*args, **kwargs):
  raise AssertionError("the model loaded before the arguments were checked")


@pytest.mark.parametrize("record, problem", [
    ('{"max_new_tokens": 0, "response_lens": [3, 5]}',
     "max_new_tokens=0: must be a whole number of tokens above 0"),
    ('{"max_new_tokens": 8, "response_lens": [3, -2]}',
     "response_lens[1]=-2: must be a whole number of tokens in [0, max_new_tokens=8]"),
    ('{"max_new_tokens": 8, "response_lens": ["a"]}',
     "response_lens[0]='a': must be a whole number of tokens in [0, max_new_tokens=8]"),
], ids=["zero_cap", "negative", "string"])
def test_planner_estimate_names_a_bad_length_record(tmp_path, record, problem, capsys):
  path = tmp_path / "lengths.json"
  path.write_text(record)
  plan = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "results",
                      "aot_qwen7b_h100x8.json")
  with pytest.raises(SystemExit) as e:
    plan_cli.main(["--render", plan, "--estimate", "--lengths", str(path)])
  assert e.value.code == cli.EXIT_USAGE
  assert capsys.readouterr().err.splitlines()[-1].startswith(
      f"{plan_cli.PROG}: error: --lengths {path}: {problem}")


def test_eval_out_is_checked_before_any_work(tmp_path, capsys):
  # The data file does not exist either: the output path is checked first.
  out = str(tmp_path / "missing_dir" / "results.json")
  assert eval_cli.main(["--data", str(tmp_path / "x.jsonl"), "--out", out]) == 1
  _one_error_line(capsys, f"cannot write {out}")
  assert eval_cli.main(["--data", str(tmp_path / "x.jsonl"), "--out", str(tmp_path)]) == 1
  _one_error_line(capsys, "is a directory")


def test_eval_with_every_prompt_dropped_is_an_error(tiny_dir, tmp_path, capsys):
  path = tmp_path / "q.jsonl"
  path.write_text(json.dumps({"problem": "What is 1 + 1?", "answer": "2"}) + "\n")
  out = tmp_path / "r.json"
  assert eval_cli.main(["--model", tiny_dir, "--data", str(path), "--max-prompt-tokens", "2",
                        "--max-new-tokens", "4", "--reward-workers", "0",
                        "--out", str(out)]) == 1
  _one_error_line(capsys, "all 1 prompts are longer than the 2 prompt tokens allowed")
  assert not out.exists()


def test_generate_beyond_the_context_is_one_line(tiny_dir, capsys):
  assert generate.main(["--model", tiny_dir, "--prompt", "Hi", "--max-new-tokens",
                        "9000"]) == 1
  _one_error_line(capsys, "exceeds the model's 8192 positions")


def test_missing_model_path_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
  args = ["--model", str(tmp_path / "nope"), "--prompt", "Hi"]
  assert generate.main(args) == 1
  _one_error_line(capsys, "nope")
  # --debug shows the traceback and keeps the exit status.
  assert generate.main(args + ["--debug"]) == 1
  err = capsys.readouterr().err
  assert "Traceback" in err and "FileNotFoundError" in err


def test_debug_keeps_a_usage_errors_exit_status(capsys):
  def bad():
    raise cli.UsageError("config.x=1: first\nconfig.y=2: second")
  assert cli.guarded(bad) == cli.EXIT_USAGE
  assert capsys.readouterr().err.splitlines() == ["error: config.x=1: first",
                                                  "error: config.y=2: second"]
  assert cli.guarded(bad, debug=True) == cli.EXIT_USAGE
  assert "Traceback" in capsys.readouterr().err


def test_a_validation_error_keeps_its_cause():
  pydantic = pytest.importorskip("pydantic")

  class ModelConfig(pydantic.BaseModel):
    max_model_len: int

    @pydantic.field_validator("max_model_len")
    @classmethod
    def fits(cls, value):
      raise ValueError(f"User-specified max_model_len ({value}) is greater than the derived "
                       "max_model_len (max_position_embeddings=128)")

  with pytest.raises(pydantic.ValidationError) as e:
    ModelConfig(max_model_len=176)
  assert str(e.value).splitlines()[0] == "1 validation error for ModelConfig"
  assert cli.one_line(e.value) == (
      "ModelConfig: max_model_len: User-specified max_model_len (176) is greater than the "
      "derived max_model_len (max_position_embeddings=128)")


def test_a_header_line_takes_the_line_that_follows():
  assert cli.one_line(ValueError("bad settings:\n  rho must be in [0, 1]\n  more")) == (
      "bad settings: rho must be in [0, 1]")


# --- the trainer's guards ------------------------------------------------------------------

def test_metrics_past_the_restored_step_are_dropped(tmp_path):
  rows = [{"step": s, "x": s} for s in (1, 2, 3, 2, 3, 4)]
  text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "x'  # cut by a kill
  (tmp_path / "metrics.jsonl").write_text(text)
  run_log.truncate(str(tmp_path), 2)
  kept = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert kept == [1, 2, 2]


def test_stop_signals_finish_the_step_then_a_second_ctrl_c_abandons_it():
  with run_guard.StopSignals() as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested == "SIGTERM"
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGTERM) is not stop._handle  # pylint: disable=protected-access


def test_non_finite_loss_stops_the_run():
  run_guard.check_finite(3, {"actor/loss": 0.5}, 2)
  with pytest.raises(run_guard.NonFiniteError,
                     match=r"step 3: actor/loss is nan; .*the last checkpoint \(step 2\) is kept"):
    run_guard.check_finite(3, {"actor/loss": float("nan")}, 2)


def test_max_new_tokens_beyond_the_context_is_caught_at_start_up():
  run_guard.check_context([100, 56], 156, TINY)
  with pytest.raises(ValueError, match="rollout.max_new_tokens=157 plus the longest prompt"):
    run_guard.check_context([100, 56], 157, TINY)


def test_gpu_runs_without_the_planned_memory_fraction_get_one_warning(monkeypatch, capsys):
  # No GPU here: the backend's name is what the check reads.
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  line = run_guard.warn_gpu_memory_fraction("jax", environ={})
  assert capsys.readouterr().err.strip() == line
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in line
  assert run_guard.warn_gpu_memory_fraction(
      "jax", environ={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}) is None
  assert run_guard.warn_gpu_memory_fraction("vllm", environ={}) is None
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert run_guard.warn_gpu_memory_fraction("jax", environ={}) is None
