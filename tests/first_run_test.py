"""docs/first_run.md rehearsed on CPU: its "Rehearse on a CPU" commands, run verbatim.

The guide's path for Qwen2.5-Math-7B (fetch, plan, train on a budget, preemption and
resume, export, PEFT, evaluation, serving) with SmolLM2-135M-Instruct and a budget of
minutes. The commands run as subprocesses in a temporary directory that links the
checkout's configs/, scripts/ and docs/, so their relative paths resolve as in a clone
and what they write stays there; offline (`HF_HUB_OFFLINE=1`), with a Hugging Face cache
that holds the embedded SmolLM2's HF directory under its hub id, as a download leaves it
(tests/hub_test.py lays it out):

* fetch finds and checks the cached copy; the planner plans this CPU (`--target=cpu`),
  and the committed H100 plan renders with its estimate;
* the run trains LoRA adapters on a budget sized from the CPU plan, checkpointing and
  exporting by wall time; it is killed (SIGKILL) after a checkpoint taken by wall time,
  the same command resumes it, and its budget ends it: the last step evaluated,
  checkpointed and exported, exit 0;
* plot_run draws it, convert exports it again, PEFT loads the adapter onto the base it
  names (the hub id, from the cache) with the merged export's logits, eval scores it;
* with vLLM's CPU build, the server on the merged export answers the guide's greedy
  request with the JAX sampler's tokens, and `eval --engine vllm` prints the JAX
  engine's table.

tests/docs_commands_test.py lists these commands as the guide's, so each is one the
guide shows. Slow (minutes of training on 2 cores): CI runs the file in its vLLM phase
(.ci/run). Assertions are on what each step prints and writes, never on its time.
"""

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from safetensors import numpy as safetensors_numpy

from exgrpo_jax import checkpointing
from exgrpo_jax import generate
from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax.models import export
from exgrpo_jax.models import hub
from exgrpo_jax.training import run_log
from tests import conftest
from tests import hub_test

HUB_ID = hub_test.SMOLLM2
MODEL = f"--config.model.hub_id={HUB_ID} --config.model.path=checkpoints/SmolLM2-135M-Instruct"
WORKDIR = "runs/rehearsal"
FETCH = f"python -m exgrpo_jax.fetch --config=configs/smollm2_135m.py {MODEL}"
PLAN = ("python -m exgrpo_jax.aot plan --config=configs/smollm2_135m.py --target=cpu "
        "--out=plan_cpu.json")
RENDER = ("python -m exgrpo_jax.aot plan --render docs/results/aot_qwen7b_lora_h100x1.json "
          "--estimate")
# The day recipe's settings (configs/common.py, day_recipe) at a CPU's scale: a budget
# of 3 minutes, checkpoints and exports every 6 seconds, 8 problems evaluated.
TRAIN = (f"python -m exgrpo_jax.train --config=configs/smollm2_135m.py --workdir={WORKDIR} "
         f"{MODEL} --config.model.lora.rank=8 --config.optim.lr=2e-4 "
         "--config.train.steps=100 --config.train.checkpoint_every=50 "
         "--config.train.budget_hours=0.05 --config.train.budget_plan=plan_cpu.json "
         "--config.train.checkpoint_every_minutes=0.1 --config.train.export_every_minutes=0.1 "
         "--config.eval.limit=8 --config.eval.subset=spread --config.eval.every=5 "
         "--config.eval.before_train=True")
PLOT = f"python scripts/plot/plot_run.py --workdir {WORKDIR}"
CONVERT = f"python -m exgrpo_jax.convert --src {WORKDIR} --dst {WORKDIR}_export"
EVAL = f"python -m exgrpo_jax.eval --model {WORKDIR}/hf --data arithmetic --limit 8 --temperature 0"
EVAL_VLLM = EVAL.replace("eval --model", "eval --engine vllm --model")
SERVE = (f"python -m vllm.entrypoints.openai.api_server --model {WORKDIR}/hf "
         "--served-model-name policy --dtype float32 --enforce-eager")
# docs/serving.md's greedy request, which the guide sends the rehearsal's server.
REQUEST = ("curl http://127.0.0.1:8000/v1/chat/completions -H \"Content-Type: "
           "application/json\" -d '{\"model\": \"policy\", \"messages\": [{\"role\": "
           "\"user\", \"content\": \"What is 8 - 1? Answer with only the number.\"}], "
           "\"temperature\": 0, \"max_tokens\": 48}'")
PEFT_SCRIPT = """
import json, torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoPeftModelForCausalLM.from_pretrained("{workdir}/hf/adapter")
merged = AutoModelForCausalLM.from_pretrained("{workdir}/hf")
base = AutoModelForCausalLM.from_pretrained("{hub_id}")
tokenizer = AutoTokenizer.from_pretrained("{workdir}/hf")
text = tokenizer.apply_chat_template([{{"role": "user", "content": "What is 8 - 1?"}}],
                                     tokenize=False, add_generation_prompt=True)
ids = tokenizer(text, return_tensors="pt").input_ids
with torch.no_grad():
  peft, merged, base = (m(ids).logits for m in (model, merged, base))
print(json.dumps(dict(base_name=model.peft_config["default"].base_model_name_or_path,
                      vs_merged=float((peft - merged).abs().max()),
                      vs_base=float((peft - base).abs().max()))))
"""
TIMEOUT_S = 1800


def test_the_rehearsal_sends_the_guides_request():
  """docs_commands_test lists the other commands; this one docs/serving.md shows too."""
  from tests import docs_commands_test  # pylint: disable=g-import-not-at-top
  assert "docs/first_run.md" in docs_commands_test.documented_commands().get(REQUEST, [])


def _argv(command: str) -> list[str]:
  """A documented `python ...` command's argv, run by this interpreter."""
  argv = shlex.split(command)
  assert argv[0] == "python", command
  return [sys.executable, *argv[1:]]


class Rehearsal:
  """The guide's clone: a directory linking the checkout's configs/, scripts/ and docs/,
  where the commands run offline with `cache` as the Hugging Face cache."""

  def __init__(self, root: str, cache: str):
    self.root, self.cache = root, cache
    for name in ("configs", "scripts", "docs"):
      os.symlink(os.path.join(conftest.REPO_ROOT, name), os.path.join(root, name))
    self.env = conftest.subprocess_env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=cache,
                                       PYTHONUNBUFFERED="1")

  def path(self, *parts: str) -> str:
    return os.path.join(self.root, *parts)

  def run(self, command: str) -> str:
    """Runs `command` here; its stdout and stderr, once it exited 0."""
    proc = subprocess.run(_argv(command), cwd=self.root, env=self.env, capture_output=True,
                          text=True, timeout=TIMEOUT_S, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command}\nexit {proc.returncode}:\n{output[-5000:]}"
    return output

  def run_until_killed(self, command: str, line: re.Pattern) -> tuple[str, re.Match]:
    """Starts `command`, sends SIGKILL once it prints a line matching `line`; its output
    and the match (the process must still run at that line: killed, not finished)."""
    proc = subprocess.Popen(_argv(command), cwd=self.root, env=self.env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    watchdog = threading.Timer(TIMEOUT_S, proc.kill)
    watchdog.start()
    lines, match = [], None
    try:
      for text in proc.stdout:
        lines.append(text)
        match = line.search(text)
        if match:
          proc.send_signal(signal.SIGKILL)
          break
      lines.append(proc.stdout.read())
      proc.wait()
    finally:
      watchdog.cancel()
    output = "".join(lines)
    assert match and proc.returncode == -signal.SIGKILL, (
        f"{command}\nexit {proc.returncode} before a line matching {line.pattern!r}:\n"
        f"{output[-5000:]}")
    return output, match


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory, smollm2_hf_dir):
  root = tmp_path_factory.mktemp("first_run")
  cache = str(tmp_path_factory.mktemp("hf_cache"))
  hub_test.lay_out(smollm2_hf_dir, cache, HUB_ID, hub.ALLOW_PATTERNS, hub.IGNORE_PATTERNS)
  return Rehearsal(str(root), cache)


@pytest.fixture(scope="module")
def fetched(rehearsal):
  return rehearsal.run(FETCH)


@pytest.fixture(scope="module")
def planned(rehearsal):
  return rehearsal.run(PLAN)


@pytest.fixture(scope="module")
def trained(rehearsal, fetched, planned):
  """The training command killed after its first checkpoint by wall time, then run
  again: (the killed run's output, its checkpoint's step, the rerun's output)."""
  del fetched, planned
  # The budget's progress line follows a checkpoint that was not the run's last.
  killed, match = rehearsal.run_until_killed(
      TRAIN, re.compile(r"^\[exgrpo_jax\] budget: step (\d+) at "))
  return killed, int(match[1]), rehearsal.run(TRAIN)


@pytest.fixture(scope="module")
def converted(rehearsal, trained):
  del trained
  return rehearsal.run(CONVERT)


def _last_step(output: str) -> int:
  return int(re.search(r"budget: stopping after step (\d+), ", output)[1])


def _table(output: str) -> list[str]:
  """eval's table rows, one per benchmark, and its average."""
  return [line for line in output.splitlines() if re.match(r"(arith_\w+|average) ", line)]


@pytest.mark.slow
def test_fetch_checks_the_copy_in_the_cache_offline(rehearsal, fetched):
  snapshot = os.path.join(rehearsal.cache, f"models--{HUB_ID.replace('/', '--')}",
                          "snapshots", hub_test.COMMIT)
  assert f"{HUB_ID}: {snapshot}\n" in fetched, fetched
  assert "  weights: 1 safetensors file, 272 tensors, every one the model reads" in fetched
  assert ("checked: a run of this config reads it while "
          "model.path=checkpoints/SmolLM2-135M-Instruct is not on disk") in fetched


@pytest.mark.slow
def test_the_planner_plans_this_cpu_and_renders_the_h100_plan(rehearsal, planned):
  with open(rehearsal.path("plan_cpu.json"), encoding="utf-8") as f:
    plan = json.load(f)
  assert plan["fits"] and plan["target"] == "cpu", plan["verdict"]
  assert f"fits: {plan['chosen']['flags']}" in planned
  rendered = rehearsal.run(RENDER)
  assert re.search(r"^\| qwen7b_lora \| h100x1 \| mid \| (\d+ \| ){6}", rendered, re.M), rendered
  # The CPU's own plan renders too: the static loop's, with no pool to show.
  own = rehearsal.run("python -m exgrpo_jax.aot plan --render plan_cpu.json")
  assert re.search(r"^\| smollm2_135m \| cpu \| 1 x 1 \| 8 \| 16 \| - \| - \| - \|", own,
                   re.M), own


@pytest.mark.slow
def test_a_killed_run_resumes_with_the_same_command_until_its_budget_ends_it(
    rehearsal, trained):
  killed, step, resumed = trained
  workdir = rehearsal.path(WORKDIR)
  assert ("model.path=checkpoints/SmolLM2-135M-Instruct is not on disk: reading "
          f"model.hub_id={HUB_ID} from the Hugging Face cache") in killed
  assert re.search(r"budget 0.05 h: about \d+ of the remaining 100 steps at \d+ s a step "
                   r"\(plan_cpu.json: the plan's step at mid response lengths", killed), killed
  assert "budget: stopping" not in killed  # killed mid-run, not at the budget's end
  assert f"resumed from {workdir}/checkpoints/{step}\n" in resumed, resumed
  last = _last_step(resumed)
  assert last > step
  assert re.search(rf"^step {last}/100 .* val=", resumed, re.M), resumed
  assert f"exported step {last} to {WORKDIR}/hf" in resumed
  assert checkpointing.latest_step_dir(checkpointing.checkpoint_dir(workdir)).endswith(
      f"/{last}")
  assert export.is_complete(os.path.join(workdir, "hf"), {"step": last})
  rows = {row["step"]: row for row in run_log.read_metrics(workdir)}
  assert sorted(rows) == list(range(last + 1))
  assert "val/avg_score" in rows[0] and "val/avg_score" in rows[last]
  assert os.listdir(os.path.join(workdir, "tensorboard"))


@pytest.mark.slow
def test_plot_run_draws_the_runs_curves(rehearsal, trained):
  last = _last_step(trained[2])
  assert f"wrote plots for {last + 1} steps to {WORKDIR}/plots" in rehearsal.run(PLOT)
  assert any(name.endswith(".png") for name in os.listdir(rehearsal.path(WORKDIR, "plots")))


@pytest.mark.slow
def test_convert_writes_the_merged_model_and_the_adapter_on_its_hub_id(rehearsal, converted):
  assert re.search(rf"^wrote {WORKDIR}_export \(llama, 134\.5M parameters\)$", converted,
                   re.M), converted
  ours, runs = (rehearsal.path(d, "adapter") for d in (f"{WORKDIR}_export", f"{WORKDIR}/hf"))
  with open(os.path.join(ours, "adapter_config.json"), encoding="utf-8") as f:
    adapter = json.load(f)
  assert adapter["base_model_name_or_path"] == HUB_ID and adapter["r"] == 8
  # The newest checkpoint is the step the run exported at its end.
  a, b = (safetensors_numpy.load_file(os.path.join(d, "adapter_model.safetensors"))
          for d in (ours, runs))
  assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_peft_loads_the_adapter_on_its_base_from_the_cache(rehearsal, trained):
  del trained
  script = PEFT_SCRIPT.format(workdir=WORKDIR, hub_id=HUB_ID)
  proc = subprocess.run([sys.executable, "-c", script], cwd=rehearsal.root, env=rehearsal.env,
                        capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
  assert proc.returncode == 0, proc.stderr[-5000:]
  found = json.loads(proc.stdout.splitlines()[-1])
  assert found["base_name"] == HUB_ID
  # The adapter on its base computes the merged export's logits (to the float32 rounding
  # of the factors applied unmerged, over 30 layers), a hundred times closer than the
  # base's, from which training moved them.
  assert found["vs_merged"] < 1e-3 and found["vs_base"] > 0.1, found


@pytest.mark.slow
def test_eval_scores_the_export(rehearsal, trained):
  del trained
  table = _table(rehearsal.run(EVAL))
  assert [row.split()[:3] for row in table] == [["arith_add", "8", "1"], ["arith_sub", "8", "1"],
                                                ["average", "(2", "sources)"]], table


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (.ci/run installs its CPU build)")
def test_vllm_serves_the_export_and_evaluates_it_as_the_jax_engine(rehearsal, trained):
  """The guide's server command on the merged export answers the greedy request with the
  JAX sampler's tokens for the chat prompt; eval with vLLM prints the JAX engine's
  table (greedy, float32)."""
  del trained
  from tests import vllm_server  # pylint: disable=g-import-not-at-top
  hf_dir = rehearsal.path(WORKDIR, "hf")
  body = json.loads(shlex.split(REQUEST)[-1])
  policy, tokenizer = models.from_pretrained(hf_dir), models.load_tokenizer(hf_dir)
  prompt = generate.encode(tokenizer, body["messages"][0]["content"], chat=True)
  expected = sampling.make_engine("jax", policy.config, tokenizer).generate(
      [prompt], 1, policy.params, jax.random.key(0),
      sampling.SamplingConfig(greedy=True, max_new_tokens=body["max_tokens"]))
  flags = shlex.split(SERVE)[shlex.split(SERVE).index(f"{WORKDIR}/hf") + 1:]
  with vllm_server.serve(hf_dir, rehearsal.path("server.log"), *flags,
                         env=dict(rehearsal.env, VLLM_CPU_KVCACHE_SPACE="1")) as server:
    answer = server.post("/v1/chat/completions", dict(body, return_token_ids=True))
  choice, n = answer["choices"][0], expected.lengths_N[0]
  assert answer["prompt_token_ids"] == prompt
  assert choice["token_ids"] == expected.tokens_NxT[0, :n].tolist()
  assert choice["message"]["content"] == expected.texts[0]
  assert _table(rehearsal.run(EVAL_VLLM)) == _table(rehearsal.run(EVAL))
