"""scripts/accelerator/gpu_followup.py, the GPU issue's prepared measurements, on CPU: its smoke
(tiny models, one training step) and its argument errors."""

import functools
import json
import os
import subprocess
import sys

import pytest

from tests import conftest

SCRIPT = os.path.join(conftest.REPO_ROOT, "scripts", "accelerator", "gpu_followup.py")
LORA = os.path.join(conftest.REPO_ROOT, "scripts", "accelerator", "gpu_lora.py")


def _run(*args, **kwargs):
  return subprocess.run([sys.executable, SCRIPT, *args], cwd=conftest.REPO_ROOT,
                        env=conftest.subprocess_env(), capture_output=True, text=True,
                        timeout=1800, check=False, **kwargs)


@pytest.mark.parametrize("args, line", [
    (["--out", "x.json", "--budget", "decode=soon"], "--budget decode=soon: give NAME=SECONDS"),
    (["--out", "x.json", "--budget", "learner=60"], "--budget learner=60: give NAME=SECONDS"),
    (["--out", "x.json", "--parts", "decode,tests"],
     "--parts: unknown tests; known: lora, decode, study"),
    ([], "--out is required"),
    (["--out", "x.json", "--jobs", "0"], "argument --jobs: must be at least 1, got 0")])
def test_bad_arguments_get_one_line(args, line, tmp_path):
  proc = subprocess.run([sys.executable, SCRIPT, *args], cwd=tmp_path, capture_output=True,
                        text=True, timeout=60, check=False)
  assert proc.returncode == 2 and line in proc.stderr.strip().splitlines()[-1]
  assert "Traceback" not in proc.stderr and not os.listdir(tmp_path)  # nothing written


@pytest.mark.parametrize("name, text, line", [
    ("notes.txt", "not JSON\n", "--out notes.txt: not a follow-up report to continue "
                                 "(Expecting value: line 1 column 1 (char 0)); name a new file"),
    ("study_gpu_runs/exgrpo_s1.json", '{"arm": "exgrpo", "se',
     "study_gpu_runs/exgrpo_s1.json: damaged run summary (Unterminated string")])
def test_a_damaged_file_it_would_continue_is_named_in_one_line(tmp_path, name, text, line):
  """--out at a file that is not a follow-up report, or a study summary cut short in the
  directory its study part continues: one line naming the file, exit 2, nothing new."""
  (tmp_path / name).parent.mkdir(exist_ok=True)
  (tmp_path / name).write_text(text, encoding="utf-8")
  before = sorted(str(p) for p in tmp_path.rglob("*"))
  out = "notes.txt" if name == "notes.txt" else "followup.json"
  proc = subprocess.run([sys.executable, SCRIPT, "--out", out, "--parts", "study"],
                        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert line in proc.stderr.strip().splitlines()[-1]
  assert sorted(str(p) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("args, line", [
    (["--render", "missing.json"], "--render missing.json: No such file or directory"),
    (["--render", "notes.txt"], "--render notes.txt: not a JSON file (Expecting value: line 1 "
                                "column 1 (char 0))"),
    (["--render", "plan.json"], "--render plan.json: not a report of this script (no "
                                "device, date, jax, questions, k, response_tokens, phases, "
                                "steps)"),
    (["--out", "x.json", "--budget", "-5"], "argument --budget: must be a number above 0, "
                                            "got -5"),
    (["--out", "file/x.json"], "--out file/x.json: cannot write file/x.json: Not a directory"),
    (["--out", "x.json", "--workdir", "file/run"],
     "--workdir file/run: cannot write there ({tmp}/file is not a directory)"),
])
def test_the_lora_part_refuses_bad_arguments_in_one_line(tmp_path, args, line):
  """gpu_lora.py's bad arguments and outputs: one line naming the flag, exit 2, before
  JAX starts or anything is written."""
  (tmp_path / "notes.txt").write_text("not JSON\n", encoding="utf-8")
  (tmp_path / "plan.json").write_text(json.dumps({"plan": "aot_qwen7b_lora_h200x1.json",
                                                  "chosen": {}}), encoding="utf-8")
  (tmp_path / "file").write_text("", encoding="utf-8")
  before = sorted(os.listdir(tmp_path))
  proc = subprocess.run([sys.executable, LORA, *args], cwd=tmp_path, capture_output=True,
                        text=True, timeout=120, check=False, env=conftest.subprocess_env())
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      f"gpu_lora.py: error: {line.format(tmp=tmp_path)}")
  assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.slow
def test_smoke_runs_every_part_and_a_rerun_skips_what_is_done(tmp_path):
  """The LoRA plan's run (SmolLM2 here, its plan compiled for this CPU), every decode
  measurement of two flag sets (each its own process) and the study's pair, two runs at
  once, one step each; a rerun measures and trains nothing again."""
  out = str(tmp_path / "followup.json")
  args = ("--smoke", "--out", out, "--jobs", "2", "--workdir", str(tmp_path / "runs"))
  proc = _run(*args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(out, encoding="utf-8") as f:
    first = json.load(f)
  lora = first["lora"]
  assert "error" not in lora and set(lora["phases"]) == {"recompute", "learner", "rollout"}
  assert lora["steps"] and all(
      step["measured_s"][p] > 0 and step["estimated_s"][p] > 0
      for step in lora["steps"] for p in ("rollout", "recompute", "learner")), lora
  assert lora["steps"][0]["mean_prompt_tokens"] > 256 - 16  # the filler prompts' bound
  assert lora["rollout_programs_gib"]  # sizes as compiled here, beside the plan's
  table = subprocess.run([sys.executable, LORA, "--render", str(tmp_path / "gpu_lora.json")],
                         cwd=conftest.REPO_ROOT, capture_output=True, text=True, timeout=60,
                         check=True).stdout
  assert all(f"| {phase} | " in table for phase in ("recompute", "learner", "rollout")), table
  decode = first["decode"]
  assert len(decode) == 2 * 4 * 3  # 2 variants x (2 models x batch 1, 8) x 3 engines
  assert all(row["tokens_per_s"] > 0 and row["hbm_bound_tokens_per_s"] > 0
             for row in decode.values()), decode
  assert first["study"]["runs"] == {"onpolicy_s1": "smoke step done",
                                    "exgrpo_s1": "smoke step done"}
  for arm in ("onpolicy", "exgrpo"):
    with open(tmp_path / "runs" / f"{arm}_s1" / "train.log", encoding="utf-8") as f:
      assert "step 1/1" in f.read()
  proc = _run(*args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(out, encoding="utf-8") as f:
    assert json.load(f) == first  # nothing measured or trained again


@pytest.mark.parametrize("target", ["h200x1", "h100x1"])
def test_the_lora_part_runs_each_gpus_plan_at_its_settings(target, tmp_path):
  """What the device would run, set up here: the plan's settings and choice agree, the
  model is the plan's 7B shape (Qwen's vocabulary), and only batch, data and evaluation
  differ from configs/qwen7b_lora.py:<target>."""
  from configs import qwen7b_lora  # pylint: disable=g-import-not-at-top
  from scripts.accelerator import gpu_lora  # pylint: disable=g-import-not-at-top
  config, shape = gpu_lora.run_config(target, str(tmp_path), smoke=False)
  report, chosen = gpu_lora._plan(target, config, smoke=False)  # pylint: disable=protected-access
  assert chosen["chosen"]["max_rows"] == config.rollout.max_rows
  assert (shape.vocab_size, shape.num_layers, shape.hidden_size) == (
      report["model"]["vocab"], report["model"]["layers"], report["model"]["hidden"])
  assert config.model.random_init and config.train.batch_questions == gpu_lora.QUESTIONS
  plain = qwen7b_lora.get_config(target)
  for key in ("mesh.shape", "optim.micro_batch_size", "optim.mini_batches",
              "rollout.max_new_tokens", "rollout.max_rows", "rollout.kv_pages",
              "data.max_prompt_tokens", "model.lora.rank", "model.dtype", "model.remat"):
    value = lambda c: functools.reduce(getattr, key.split("."), c)  # pylint: disable=cell-var-from-loop
    assert value(config) == value(plain), key
  # The order of the part: the recompute's and the learner's peaks show before the rollout's.
  peaks = gpu_lora.plan_peaks(report)
  assert peaks["rollout"] >= peaks["learner"] > peaks["recompute"] > 0


def test_the_lora_part_names_a_gpu_without_a_plan_in_one_line():
  from exgrpo_jax import cli  # pylint: disable=g-import-not-at-top
  from scripts.accelerator import gpu_lora  # pylint: disable=g-import-not-at-top
  assert gpu_lora.target_of("NVIDIA H100 80GB HBM3") == "h100x1"
  with pytest.raises(cli.UsageError, match="no one-GPU LoRA plan for a NVIDIA A100"):
    gpu_lora.target_of("NVIDIA A100-SXM4-80GB")


def test_the_lora_parts_prompts_have_the_plans_length(tmp_path, smollm2_hf_dir):
  """The filler questions render, in the plan's template, within `SLACK` tokens of the
  plan's 1,024, each question once."""
  del smollm2_hf_dir  # the embedded model's tokenizer
  from configs import qwen7b_lora  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import data  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import models  # pylint: disable=g-import-not-at-top
  from scripts.accelerator import gpu_lora  # pylint: disable=g-import-not-at-top
  config, tokenizer = qwen7b_lora.get_config("h200x1"), models.load_tokenizer()
  path = gpu_lora.prompt_file(tokenizer, config.data.template, config.data.max_prompt_tokens,
                              8, str(tmp_path / "prompts.jsonl"))
  questions = data.load_questions(path).questions
  prompts, dropped = data.render_prompts(questions, tokenizer, template=config.data.template,
                                         max_prompt_tokens=config.data.max_prompt_tokens)
  assert dropped == 0 and len({q.problem for q in questions}) == 8
  assert all(1024 - gpu_lora.SLACK <= len(p.ids) <= 1024 for p in prompts)
