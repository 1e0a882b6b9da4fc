"""Evaluation metrics against hand computations, the driver's grading plumbing (with a
scripted engine), and the real CLI end to end (slow)."""

import dataclasses
import itertools
import json
import math
import os
import types

import jax
import numpy as np
import pytest

from exgrpo_jax import data
from exgrpo_jax import rewards
from exgrpo_jax.evaluation import metrics
from exgrpo_jax.evaluation import runner
from exgrpo_jax.rewards import graders
from tests.sampling_cli_test import tiny_dir  # pylint: disable=unused-import


def _pass_at_k_by_enumeration(n, c, k):
  """The fraction of k-subsets of n samples (c correct) that hold a correct one."""
  outcomes = [True] * c + [False] * (n - c)
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration():
  for n in range(1, 9):
    for c in range(n + 1):
      for k in range(1, n + 1):
        assert metrics.pass_at_k(n, c, k) == pytest.approx(
            _pass_at_k_by_enumeration(n, c, k), abs=1e-12)
  # Large n: the product form against exact binomials.
  assert metrics.pass_at_k(1000, 7, 32) == pytest.approx(
      1 - math.comb(993, 32) / math.comb(1000, 32), rel=1e-12)
  with pytest.raises(ValueError):
    metrics.pass_at_k(4, 5, 1)


def test_k_values():
  assert metrics.k_values(1) == [1]
  assert metrics.k_values(8) == [1, 2, 4, 8]
  assert metrics.k_values(12) == [1, 2, 4, 8, 12]


def test_summarize_by_hand():
  # Question 7: 3 of 4 samples right; question 2: 0 of 4.
  group = np.array([7, 7, 2, 7, 2, 2, 7, 2])
  correct = np.array([1, 1, 0, 0, 0, 0, 1, 0], bool)
  length = np.array([10, 20, 30, 40, 50, 60, 70, 80])
  truncated = np.array([0, 0, 0, 0, 0, 0, 1, 1], bool)
  status = np.array(["ok"] * 6 + ["format", "no_answer"], object)
  s = metrics.summarize(group, correct, length, truncated, status)
  assert (s["questions"], s["samples"], s["k"]) == (2, 8, 4)
  assert s["avg@k"] == pytest.approx((3 / 4 + 0) / 2)
  assert s["pass@k"]["1"] == pytest.approx(3 / 8)
  assert s["pass@k"]["2"] == pytest.approx((1 - 0 / 6) / 2)  # C(1,2) = 0
  assert s["pass@k"]["4"] == pytest.approx(0.5)
  assert s["mean_response_length"] == pytest.approx(45.0)
  assert s["truncated_frac"] == pytest.approx(0.25)
  assert s["format_frac"] == s["no_answer_frac"] == pytest.approx(1 / 8)


class CharTokenizer:
  """Characters as token ids; no chat template and no BOS."""

  chat_template = None
  bos_token = None
  name_or_path = "chars"

  def __call__(self, texts, add_special_tokens=True):
    del add_special_tokens
    return {"input_ids": [[ord(ch) for ch in t] for t in texts]}


class ScriptedEngine:
  """Answers each prompt from `script[problem]`, cycling through its responses.

  Only a stand-in for the rollout engine in tests of grading and metric plumbing.
  """

  def __init__(self, script):
    self.script = {p: itertools.cycle(r) for p, r in script.items()}
    self.keys = []

  def generate(self, prompt_ids, n, params, key, sampling_config):
    assert params == "params" and sampling_config.temperature == 0.6
    self.keys.append(np.asarray(jax.random.key_data(key)).tolist())
    texts = []
    for ids in prompt_ids:
      text = "".join(map(chr, ids))
      problem = text.split("User: ", 1)[-1].split("\nAssistant:")[0]
      problem = problem.split("This is the problem: ", 1)[-1].split(" Assistant:")[0]
      texts += [next(self.script[problem]) for _ in range(n)]
    return types.SimpleNamespace(
        texts=texts, lengths_N=np.array([len(t) for t in texts]),
        truncated_N=np.array([t.endswith("...") for t in texts]),
        prompt_index_N=np.repeat(np.arange(len(prompt_ids)), n))


def _question(uid, problem, truth, source):
  return data.Question(uid, ({"role": "user", "content": problem},), truth, source,
                       graders.reward_for_source(source))


def test_evaluate_groups_repeated_rows_and_grades_by_source():
  # aime: A repeated 4 rows, B repeated 4 rows; n = 2 -> 8 samples per question.
  questions = [_question(i, "A?", "1", "aime") for i in range(4)]
  questions += [_question(4 + i, "B?", "2", "aime") for i in range(4)]
  questions += [_question(8, "P?", "A", "arc_c"), _question(9, "Q?", "B", "arc_c"),
                _question(10, "R?", "C", "arc_c")]
  script = {"A?": ["\\boxed{1}", "\\boxed{3}", "\\boxed{4}", "\\boxed{5}"],
            "B?": ["\\boxed{7}"],
            "P?": ["ANSWER: A"], "Q?": ["ANSWER: B", "ANSWER: D..."], "R?": ["hmm..."]}
  engine = ScriptedEngine(script)
  sampling_config = types.SimpleNamespace(temperature=0.6)
  with rewards.RewardPool(num_workers=0, timeout_s=10.0) as pool:
    results = runner.evaluate(engine, "params", CharTokenizer(), questions, sampling_config,
                              pool, jax.random.key(0),
                              runner.EvalOptions(template="plain", n=2, batch_prompts=3))
  aime, arc = results["per_source"]["aime"], results["per_source"]["arc_c"]
  assert (aime["questions"], aime["samples"], aime["k"]) == (2, 16, 8)
  assert aime["avg@k"] == pytest.approx((2 / 8 + 0) / 2)
  assert aime["pass@k"]["2"] == pytest.approx((1 - math.comb(6, 2) / math.comb(8, 2)) / 2)
  assert aime["pass@k"]["4"] == pytest.approx((1 - math.comb(6, 4) / math.comb(8, 4)) / 2)
  assert aime["pass@k"]["8"] == pytest.approx(0.5)
  assert (arc["questions"], arc["k"]) == (3, 2)
  assert arc["avg@k"] == pytest.approx((1 + 0.5 + 0) / 3)
  assert arc["no_answer_frac"] == pytest.approx(2 / 6)
  assert arc["truncated_frac"] == pytest.approx(3 / 6)
  assert arc["mean_response_length"] == pytest.approx(
      (2 * 9 + 9 + 12 + 2 * 6) / 6)
  assert results["overall"]["avg@k"] == pytest.approx((aime["avg@k"] + arc["avg@k"]) / 2)
  assert results["reward_stats"]["total"] == 22
  assert len(engine.keys) == 4 and len({str(k) for k in engine.keys}) == 4  # a key per call
  table = runner.format_table(results)
  assert "aime" in table and "arc_c" in table and "average (2 sources)" in table
  json.dumps(results)  # JSON-friendly


def test_evaluate_think_gate_and_dropped_prompts():
  questions = [_question(0, "A?", "1", "math"), _question(1, "B?" + "x" * 500, "2", "math")]
  engine = ScriptedEngine({"A?": ["\\boxed{1}", "ok</think> \\boxed{1}"]})
  with rewards.RewardPool(num_workers=0, timeout_s=10.0) as pool:
    results = runner.evaluate(engine, "params", CharTokenizer(), questions,
                              types.SimpleNamespace(temperature=0.6), pool, jax.random.key(1),
                              runner.EvalOptions(template="exgrpo_think", n=2,
                                                 max_prompt_tokens=1100, keep_responses=True))
  assert results["dropped_prompts"] == 1
  math_ = results["per_source"]["math"]
  assert math_["avg@k"] == pytest.approx(0.5) and math_["format_frac"] == pytest.approx(0.5)
  assert [r["status"] for r in results["responses"]] == ["format", "ok"]


@pytest.mark.slow
def test_cli_end_to_end_on_the_embedded_model(shared_data_dir, tmp_path):
  from exgrpo_jax import eval as eval_cli  # pylint: disable=g-import-not-at-top
  out = tmp_path / "results.json"
  argv = ["--data", os.path.join(shared_data_dir, "exgrpo_test_id.parquet"),
          "--data", os.path.join(shared_data_dir, "ood_arc_c.parquet"),
          "--limit", "2", "--max-new-tokens", "24", "--n", "2", "--out", str(out),
          "--save-responses", "--reward-workers", "1"]
  assert eval_cli.main(argv) == 0
  results = json.loads(out.read_text())
  expected_sources = {"aime", "aime25", "amc", "math", "minerva", "olympiad_bench", "arc_c"}
  assert set(results["per_source"]) == expected_sources
  responses = results["responses"]
  assert len(responses) == 7 * 2 * 2
  # Every stored reward is what the grader says for the stored response (no gate: chat).
  for r in responses:
    name = graders.reward_for_source(r["data_source"])
    assert graders.grade(r["response"], r["ground_truth"], name, False) == (
        r["reward"], r["status"])
  for source, summary in results["per_source"].items():
    mine = [r["reward"] > 0 for r in responses if r["data_source"] == source]
    assert summary["samples"] == 4 and 0.0 <= summary["truncated_frac"] <= 1.0
    if source in ("aime", "aime25", "amc"):  # two identical rows: one question, k = 4
      assert (summary["questions"], summary["k"]) == (1, 4)
    assert summary["pass@k"]["1"] == pytest.approx(np.mean(mine))


def test_load_model_reads_training_checkpoints(tmp_path, smollm2_hf_dir):
  from exgrpo_jax import checkpointing  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import eval as eval_cli  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import models  # pylint: disable=g-import-not-at-top
  cfg = models.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
  params = models.init_params(cfg, jax.random.key(3))
  store = checkpointing.CheckpointStore(str(tmp_path))
  store.save(5, params, {"count": np.zeros(())}, {},
             dict(model_config=checkpointing.model_config_to_json(cfg),
                  tokenizer_source=smollm2_hf_dir))
  store.close()
  loaded_cfg, loaded, tokenizer = eval_cli.load_model(str(tmp_path), "float32")
  assert loaded_cfg == cfg
  jax.tree.map(np.testing.assert_array_equal, loaded, params)
  assert tokenizer.eos_token == "<|im_end|>"


def test_default_token_budget_is_the_tasks(tiny_dir, tmp_path, capsys):
  from exgrpo_jax import eval as eval_cli  # pylint: disable=g-import-not-at-top
  out = tmp_path / "r.json"
  assert eval_cli.main(["--model", tiny_dir, "--data", "arithmetic", "--limit", "2",
                        "--reward-workers", "0", "--out", str(out)]) == 0
  results = json.loads(out.read_text())
  assert results["config"]["max_new_tokens"] == eval_cli.ARITHMETIC_MAX_NEW_TOKENS == 48
  assert "[eval] up to 48 new tokens: the task's budget" in capsys.readouterr().err
  # The budgets are the configs' for the same data: the CPU run's and the paper runs'.
  import importlib  # pylint: disable=g-import-not-at-top
  configs = {name: importlib.import_module(f"configs.{name}").get_config()
             for name in ("smollm2_135m", "qwen7b")}
  assert configs["smollm2_135m"].data.source == "arithmetic"
  assert eval_cli.ARITHMETIC_MAX_NEW_TOKENS == configs["smollm2_135m"].eval.max_new_tokens
  assert eval_cli.FILE_MAX_NEW_TOKENS == configs["qwen7b"].eval.max_new_tokens


def test_default_token_budget_fits_the_context_after_the_longest_prompt(
    text_model, tmp_path, capsys):
  from exgrpo_jax import eval as eval_cli  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.models import export  # pylint: disable=g-import-not-at-top
  cfg, params, tokenizer = text_model
  questions = eval_cli.select(data.arithmetic.make_questions(
      data.arithmetic.ArithmeticSettings(), "eval"), 2, "")
  prompts, _ = data.render_prompts(questions, tokenizer, "chat", remove_system=True)
  longest = max(len(p.ids) for p in prompts)
  small = str(tmp_path / "small")  # room for 10 new tokens after the longest prompt
  export.save_pretrained(dataclasses.replace(cfg, max_position_embeddings=longest + 10),
                         params, small)
  tokenizer.save_pretrained(small)
  out = tmp_path / "r.json"
  argv = ["--model", small, "--data", "arithmetic", "--limit", "2", "--reward-workers", "0",
          "--save-responses", "--out", str(out)]
  assert eval_cli.main(argv) == 0
  results = json.loads(out.read_text())
  assert results["config"]["max_new_tokens"] == 10
  assert (f"[eval] up to 10 new tokens: the task's 48 cut to the model's {longest + 10} "
          f"positions less the longest prompt ({longest} tokens)") in capsys.readouterr().err
  assert results["dropped_prompts"] == 0 and len(results["responses"]) == 4
  # A budget given on the command line that leaves no room is one line.
  assert eval_cli.main(argv[:-2] + ["--max-new-tokens", str(longest + 10)]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1] == (f"error: --max-new-tokens {longest + 10} leaves no room for a prompt "
                     f"in the model's {longest + 10} positions"), err


@pytest.mark.parametrize("dtype,expected", [("float32", "highest"), ("bfloat16", "default")])
def test_eval_and_generate_run_at_a_training_runs_matmul_precision(monkeypatch, dtype,
                                                                   expected):
  """As the trainer (model.matmul_precision auto): JAX's own default is TF32 for float32
  matmuls on NVIDIA GPUs. The process's setting is left as it was."""
  from exgrpo_jax import eval as eval_cli  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import generate  # pylint: disable=g-import-not-at-top
  before, seen = jax.config.jax_default_matmul_precision, []
  record = lambda args: seen.append(jax.config.jax_default_matmul_precision) or 0
  monkeypatch.setattr(eval_cli, "_evaluate", record)
  monkeypatch.setattr(generate, "_generate", record)
  assert eval_cli.main(["--data", "x.jsonl", "--dtype", dtype, "--no-compile-cache"]) == 0
  assert generate.main(["--prompt", "hi", "--dtype", dtype, "--no-compile-cache"]) == 0
  assert seen == [expected, expected]
  assert jax.config.jax_default_matmul_precision == before
