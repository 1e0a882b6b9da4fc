r"""Runs the fault-injection suite and prints its table (tried / handled or survived).

Shown in docs/reliability.md (the table of faults and bad inputs).

  python scripts/plot/fault_table.py          # default-suite cases (library level)
  python scripts/plot/fault_table.py --slow   # plus the process-level kills (minutes)

Runs `pytest tests/fault_*_test.py` with a JUnit report and sorts every case into bad
inputs or kills and faults (CASES below); a case counts as handled / survived when its
test passes, i.e. the outcome it asserts (an exact resume from the right checkpoint, a
refusal, or a one-line error) happened. Prints JSON, then a Markdown table
(docs/reliability.md).
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INPUT, FAULT = "bad input", "kill or fault"
# test name -> (kind, what is tried; what must happen)
CASES = {
    "test_intact_run_restores_newest_step": (FAULT, "intact checkpoints; newest restored"),
    "test_damaged_item_falls_back_to_previous_step": (
        FAULT, "64 flipped bytes / truncation in one checkpoint item; fallback, one line"),
    "test_empty_and_partial_step_directories_are_skipped": (
        FAULT, "empty and partial step directories; fallback, one line each"),
    "test_legacy_checkpoint_without_manifest_is_checked_for_finite_values": (
        FAULT, "NaNs in a checkpoint without manifest; caught by the value check"),
    "test_every_step_damaged_is_one_error_and_nothing_is_moved": (
        FAULT, "every checkpoint damaged; one-line error, nothing moved"),
    "test_non_finite_params_are_never_saved_and_keep_the_last_good": (
        FAULT, "non-finite parameters at a save; refused, last good kept"),
    "test_rotation_keeps_the_newest_complete_steps": (FAULT, "rotation keeps the newest"),
    "test_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_last": (
        FAULT, "full disk (tmpfs) at a checkpoint; one line, last kept"),
    "test_read_only_checkpoint_dir_is_one_line": (
        FAULT, "read-only checkpoint directory; one line"),
    "test_second_holder_is_refused_with_the_first_ones_pid_and_host": (
        FAULT, "second holder of a workdir lock; refused naming pid and host"),
    "test_lock_of_a_killed_run_is_taken_over": (FAULT, "lock of a SIGKILLed run; taken over"),
    "test_release_frees_it_within_one_process": (FAULT, "lock released and re-acquired"),
    "test_workers_ignore_sigterm_and_sigint_of_the_process_group": (
        FAULT, "SIGTERM + SIGINT to reward workers; scores unchanged"),
    "test_worker_killed_while_starting_is_replaced_and_counted": (
        FAULT, "reward worker SIGKILLed while starting; replaced, counted"),
    "test_export_is_atomic_and_a_failed_one_leaves_the_previous": (
        FAULT, "disk full during an export; previous export intact"),
    "test_export_killed_midway_is_redone_and_its_leftovers_removed": (
        FAULT, "leftovers of a killed export; redone, cleaned"),
    "test_export_refuses_to_replace_a_directory_that_is_not_a_model": (
        INPUT, "export onto a non-model directory; refused"),
    "test_truncated_safetensors_is_one_line": (INPUT, "truncated safetensors; one line"),
    "test_huge_safetensors_header_is_one_line": (INPUT, "huge safetensors header; one line"),
    "test_convert_damaged_workdir_is_one_line": (INPUT, "convert of a damaged workdir; one line"),
    "test_eval_zero_counts_are_usage_errors": (INPUT, "eval --batch-prompts 0 / --n 0; exit 2"),
    "test_eval_negative_counts_are_usage_errors": (
        INPUT, "eval --limit -1 / --max-prompt-tokens -3; exit 2"),
    "test_a_file_that_is_not_gguf_is_named": (INPUT, "a .gguf that is not one; one line"),
    "test_convert_of_a_workdir_without_a_checkpoint_says_so": (
        INPUT, "convert of a workdir with no checkpoint; one line"),
    "test_debug_keeps_a_usage_errors_exit_status": (
        INPUT, "a config error with --debug; the traceback, exit 2"),
    "test_a_validation_error_keeps_its_cause": (
        INPUT, "a pydantic validation error; one line with its cause"),
    "test_a_header_line_takes_the_line_that_follows": (
        INPUT, "a multi-line error; its header and the next line"),
    "test_gpu_runs_without_the_planned_memory_fraction_get_one_warning": (
        INPUT, "a GPU without XLA_PYTHON_CLIENT_MEM_FRACTION; one warning line"),
    "test_a_start_refused_after_the_state_is_created_leaves_nothing_behind": (
        INPUT, "a start refused after the model is read; one line, exit 1, the workdir as "
               "found"),
    "test_eval_out_is_checked_before_any_work": (
        INPUT, "eval --out unwritable / a directory; one line before work"),
    "test_eval_with_every_prompt_dropped_is_an_error": (
        INPUT, "eval with every prompt dropped; one line, exit 1"),
    "test_generate_beyond_the_context_is_one_line": (
        INPUT, "generate past the model's context; one line"),
    "test_missing_model_path_is_one_line_and_debug_shows_the_traceback": (
        INPUT, "missing model path; one line (--debug: traceback)"),
    "test_metrics_past_the_restored_step_are_dropped": (
        FAULT, "metrics rows past the restored step (and a cut line); dropped"),
    "test_stop_signals_finish_the_step_then_a_second_ctrl_c_abandons_it": (
        FAULT, "SIGTERM then a second Ctrl-C; finish, then abandon"),
    "test_non_finite_loss_stops_the_run": (FAULT, "NaN loss; run stops, last checkpoint kept"),
    "test_max_new_tokens_beyond_the_context_is_caught_at_start_up": (
        INPUT, "rollout.max_new_tokens past the context; caught at start-up"),
    "test_sigterm_and_ctrl_c_to_the_process_group_while_scoring": (
        FAULT, "SIGTERM and Ctrl-C to the trainer's group while scoring; exit 75, exact resume"),
    "test_second_trainer_refused_damaged_checkpoint_and_lost_export": (
        FAULT, "second trainer; damaged newest checkpoint; lost export: refusal, exact "
               "resume, export redone"),
    "test_sigkill_during_a_checkpoint_resumes_from_the_previous": (
        FAULT, "SIGKILL during a checkpoint; previous step restored"),
    "test_sigkill_during_an_export_keeps_the_previous_and_a_rerun_completes": (
        FAULT, "SIGKILL during an export; previous kept, rerun completes"),
    "test_full_workdir_is_one_line": (FAULT, "trainer on a full workdir (tmpfs); one line"),
    "test_sigkill_during_the_first_checkpoint_logs_each_step_once_on_rerun": (
        FAULT, "SIGKILL during the first checkpoint; the rerun logs each step once "
               "(metrics.jsonl, eval_samples.jsonl)"),
    "test_bench_admission_bad_numbers_are_refused_before_the_model_loads": (
        INPUT, "bench_admission.py --headroom 1.5 / --rows 0 / --repeats 0; exit 2 before "
               "the model loads"),
    "test_planner_estimate_names_a_bad_length_record": (
        INPUT, "planner --estimate --lengths: a cap of 0, a negative length, a string; exit "
               "2 naming the file and the key or row"),
    "test_rollout_pool_settings_are_refused_before_compiling[headroom_without_pool]": (
        INPUT, "`--config.rollout.kv_headroom=0.5` without `rollout.kv_pages`; exit 2: "
               "`config.rollout.kv_headroom=0.5: is read only with a capped pool ...`"),
    "test_rollout_pool_settings_are_refused_before_compiling[pool_below_one_row]": (
        INPUT, "`--config.rollout.kv_pages=1 --config.rollout.max_new_tokens=64`; exit 2 "
               "before compiling: `config.rollout.kv_pages=1: 1 pages per batch shard ..., "
               "fewer than one row at its longest ...`; no workdir left"),
    "test_rollout_pool_settings_are_refused_before_compiling[negative_max_rows]": (
        INPUT, "`--config.rollout.max_rows=-5`; exit 2: `config.rollout.max_rows=-5: must be "
               "a number in [0, inf]`"),
    # python -m exgrpo_jax.train (tests/fault_train_cli_test.py): the flag or config
    # given; the exit status and the one line the user sees.
    "test_bad_flags_exit_2_with_one_line[unknown_flag]": (
        INPUT, "`--bogus_flag=1`; exit 2: `Unknown command line flag 'bogus_flag'`"),
    "test_bad_flags_exit_2_with_one_line[bad_value]": (
        INPUT, "`--config.train.steps=abc`; exit 2: `flag --config.train.steps=abc: invalid "
               "literal for int() with base 10: 'abc'`"),
    "test_bad_flags_exit_2_with_one_line[positional]": (
        INPUT, "a positional argument; exit 2: `unexpected arguments: extra`"),
    "test_bad_flags_exit_2_with_one_line[missing_config]": (
        INPUT, "`--config=configs/nope.py`; exit 2: `--config=configs/nope.py: no such file`"),
    "test_bad_flags_exit_2_with_one_line[unknown_variant]": (
        INPUT, "`--config=configs/tiny.py:nope`; exit 2: `--config=configs/tiny.py:nope: "
               "config argument 'nope': give one variant; unknown: nope; variants: exgrpo, "
               "...`"),
    "test_help_exits_0": (INPUT, "`--helpshort`; the usage, exit 0 (was 1)"),
    "test_config_key_typo_names_the_closest_key[key]": (
        INPUT, "`--config.algo.rhoo=0.3`; exit 2: `--config.algo.rhoo: no such config key; "
               "did you mean --config.algo.rho?`"),
    "test_config_key_typo_names_the_closest_key[section]": (
        INPUT, "`--config.algoo.rho=0.3`; exit 2: `--config.algoo.rho: no such config key; "
               "did you mean --config.algo.rho?`"),
    "test_config_key_typo_names_the_closest_key[plural]": (
        INPUT, "`--config.train.batch_question=8`; exit 2: `... did you mean "
               "--config.train.batch_questions?`"),
    "test_data_path_without_a_file_source_is_refused[train_path]": (
        INPUT, "smollm2_135m `--config.data.train_path=/data/mine.parquet`; exit 2: "
               "`config.data.train_path='/data/mine.parquet': is read only with "
               "data.source='file', and this config's source is 'arithmetic'; add "
               "--config.data.source=file, or drop the path`"),
    "test_data_path_without_a_file_source_is_refused[eval_path]": (
        INPUT, "smollm2_135m `--config.eval.path=/data/valid.parquet`; exit 2: the same line "
               "for eval.path / eval.source"),
    "test_batch_larger_than_the_data_is_refused": (
        INPUT, "tiny `--config.train.batch_questions=1000`; exit 2: "
               "`config.train.batch_questions=1000: more than the 64 training questions of "
               "arithmetic:train (a batch never holds a question twice); lower it, or raise "
               "data.limit`"),
    "test_resume_that_changes_what_the_checkpoint_fixes_is_refused[seed]": (
        INPUT, "resume with `--config.train.seed=1`; exit 2: `config.train.seed=1: the "
               "checkpoint being resumed was trained with 0; resume with that value or start "
               "a new workdir`; nothing moved"),
    "test_resume_that_changes_what_the_checkpoint_fixes_is_refused[model_shape]": (
        INPUT, "resume with `--config.model.arch.hidden_size=128`; exit 2: "
               "`config.model.arch.hidden_size=128: the checkpoint being resumed was trained "
               "with 64; ...`; nothing moved"),
    "test_resume_that_changes_the_algorithm_warns_per_key": (
        INPUT, "resume with `--config.algo.rho=0.25 --config.optim.lr=0.0003`; runs, with "
               "`[exgrpo_jax] warning: config.algo.rho=0.25 differs from the checkpoint's 0.5 "
               "at step 2; the resumed run uses the new value` (and one for lr)"),
}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--slow", action="store_true", help="include the process-level kills")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    report = os.path.join(tmp, "junit.xml")
    tests = sorted(os.path.join("tests", f) for f in os.listdir(os.path.join(REPO, "tests"))
                   if re.fullmatch(r"fault_\w+_test\.py", f))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--junitxml={report}", *tests] + (["-m", "slow or not slow"] if args.slow else [])
    subprocess.run(cmd, cwd=REPO, check=False)
    cases = ET.parse(report).getroot().iter("testcase")
    rows = []
    for case in cases:
      name = case.get("name")
      base = name.split("[")[0]
      kind, what = CASES.get(name) or CASES.get(base, ("unclassified", base))
      outcome = ("skipped" if case.find("skipped") is not None else
                 "failed" if case.find("failure") is not None or case.find("error") is not None
                 else "passed")
      rows.append(dict(kind=kind, case=name, what=what, outcome=outcome))
  totals = collections.defaultdict(collections.Counter)
  for r in rows:
    totals[r["kind"]][r["outcome"]] += 1
  summary = {k: dict(tried=c["passed"] + c["failed"], handled=c["passed"],
                     skipped=c["skipped"]) for k, c in totals.items()}
  print(json.dumps({"summary": summary, "cases": rows}, indent=1))
  print("\n| kind | tried | handled cleanly / survived | skipped |\n|---|---|---|---|")
  for kind, s in sorted(summary.items()):
    print(f"| {kind} | {s['tried']} | {s['handled']} | {s['skipped']} |")
  print("\n| kind | case | tried; expected | outcome |\n|---|---|---|---|")
  for r in rows:
    print(f"| {r['kind']} | `{r['case']}` | {r['what']} | {r['outcome']} |")


if __name__ == "__main__":
  main()
