"""The vLLM engine against a stand-in `vllm` module (tests/vllm_stand_in.py).

The stand-in implements only the calls the engine makes and records them, so these tests
show what the engine asks of vLLM: its options, the sleep/wake order around each JAX
phase, the weights (HF name, shape, dtype, values), the split of rows over processes and
the refusal of memory splits that cannot fit. The weight layouts are checked for real by
loading the hand-off into a transformers model and comparing logits. The real vLLM (its
CPU build) is tested in tests/vllm_real_test.py; the stand-in stays for what only CUDA
has: sleep and wake, and the external launcher across GPUs.
"""

import dataclasses
import logging
import functools
import sys
import types

import jax
import ml_collections
import numpy as np
import pytest

from configs import common
from exgrpo_jax import cli
from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax import sharding
from exgrpo_jax.models import export
from exgrpo_jax.sampling import vllm_console
from exgrpo_jax.sampling import vllm_engine
from exgrpo_jax.sampling import vllm_setup
from tests import vllm_stand_in
from tests import vllm_two_process_main

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = models.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False,
                          attention_bias=True, eos_token_id=(2,), max_position_embeddings=64)
PROMPTS = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15], [16, 17]]
COUNTS = [3, 0, 2, 4, 1, 2]


@functools.lru_cache(maxsize=None)
def tiny_params(cfg=TINY):
  """`cfg`'s random params, sharded over every device (of every process) like the learner's."""
  mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(shape=(-1, 1),
                                                           axes=("fsdp", "tensor"))))
  return models.init_params(cfg, jax.random.key(0), models.param_shardings(cfg, mesh))


@pytest.fixture
def stand_in(monkeypatch):
  """`import vllm` gives the stand-in; an 80 GiB GPU; the availability check passes."""
  monkeypatch.setitem(sys.modules, "vllm", vllm_stand_in)
  monkeypatch.setattr(vllm_engine, "check_available", lambda: "cuda")
  monkeypatch.setattr(vllm_engine, "_device_bytes", lambda rank: 80 * vllm_setup.GIB)
  vllm_stand_in.INSTANCES.clear()
  return vllm_stand_in


def make(cfg=TINY, **options):
  options = vllm_setup.VllmOptions(**dict(dict(max_model_len=48), **options))
  return vllm_engine.VllmEngine(cfg, vllm_stand_in.tiny_tokenizer(cfg.vocab_size), options)


def random_qwen2(directory, hidden_size: int, scale: float, **config):
  """A random 2-layer Qwen2 (biases, untied head: every layout) saved by transformers to
  `directory`, and our policy loaded from it: (its HF config, the policy)."""
  torch.manual_seed(0)
  hf_cfg = transformers.Qwen2Config(
      vocab_size=96, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      tie_word_embeddings=False, **config)
  source = transformers.Qwen2ForCausalLM(hf_cfg).float()
  with torch.no_grad():
    for p in source.parameters():
      p.copy_(scale * torch.randn_like(p))
  source.save_pretrained(directory)
  return hf_cfg, models.from_pretrained(str(directory))


def test_the_weights_load_into_transformers_with_identical_logits(tmp_path):
  hf_cfg, policy = random_qwen2(tmp_path, hidden_size=32, scale=0.1)

  weights = list(vllm_engine.torch_weights(policy.config, policy.params, "float32"))
  names = [name for name, _ in weights]
  assert len(names) == len(set(names))
  target = transformers.Qwen2ForCausalLM(hf_cfg).float().eval()
  expected = {k for k in target.state_dict() if not k.endswith("rotary_emb.inv_freq")}
  assert set(names) == expected
  # Layer by layer (vLLM's reload holds a layer's tensors until its last one arrives).
  layers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
  assert layers == sorted(layers) and names[-1].startswith("model.layers.1.")
  target.load_state_dict(dict(weights), strict=False)

  ids = np.random.default_rng(0).integers(0, 96, (2, 11))
  with torch.no_grad():
    hf_logits = target(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(policy(ids)), hf_logits, atol=1e-5)


def test_every_weight_reaches_vllm_with_its_hf_name_shape_and_dtype(stand_in):
  cfg = dataclasses.replace(TINY, dtype="bfloat16")
  params = tiny_params()  # the compute dtype does not change the (float32) params
  engine = make(cfg)
  engine.generate(PROMPTS, COUNTS, params, jax.random.key(0), sampling.SamplingConfig(
      max_new_tokens=5))
  expected = list(export.hf_state_dict(cfg, params, dtype="bfloat16"))
  llm = stand_in.INSTANCES[0]
  loaded = [n for kind, names in llm.calls if kind == "reload_weights" for n in names]
  assert sorted(loaded) == sorted(name for name, _ in expected)  # each once
  for name, array in expected:
    shape, dtype, values = llm.generated_with[name]
    assert shape == array.shape and dtype == torch.bfloat16, name
    np.testing.assert_array_equal(values, array.astype(np.float32), err_msg=name)


def test_engine_passes_the_configured_options(stand_in):
  c = common.base_config()
  c.rollout.engine = "vllm"
  c.data.max_prompt_tokens, c.rollout.max_new_tokens = 40, 24
  c.eval.every = 0
  c.train.seed = 5
  c.rollout.vllm.update(dict(gpu_memory_utilization=0.25, max_num_seqs=64, sleep_level=1,
                             enforce_eager=True, dtype="bfloat16"))
  options = vllm_setup.VllmOptions.from_config(c)
  engine = vllm_engine.VllmEngine(TINY, stand_in.tiny_tokenizer(96), options)
  kwargs = stand_in.INSTANCES[0].kwargs
  assert {k: kwargs[k] for k in ("gpu_memory_utilization", "tensor_parallel_size",
                                 "max_model_len", "max_num_seqs", "enforce_eager",
                                 "enable_sleep_mode", "seed", "dtype", "load_format",
                                 "logprobs_mode")} == dict(
      gpu_memory_utilization=0.25, tensor_parallel_size=1, max_model_len=64,
      max_num_seqs=64, enforce_eager=True, enable_sleep_mode=True, seed=5,
      dtype="bfloat16", load_format="dummy", logprobs_mode="processed_logprobs")
  assert "distributed_executor_backend" not in kwargs  # one process: vLLM's default
  engine.generate(PROMPTS, COUNTS, tiny_params(), jax.random.key(0),
                  sampling.SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=6))
  assert engine.memory.kv_sequences > 0
  # rollout.vllm.dtype: a bfloat16 vLLM beside the float32 model gets bfloat16 weights.
  assert {v[1] for v in stand_in.INSTANCES[0].loaded.values()} == {torch.bfloat16}
  assert [c[1] for c in stand_in.INSTANCES[0].calls if c[0] == "sleep"] == [1]

  c.eval.every, c.eval.max_new_tokens = 10, 100  # evaluation's longer answers count
  assert vllm_setup.VllmOptions.from_config(c).max_model_len == 140


def test_a_length_budget_past_the_models_positions_is_capped(stand_in):
  # data.max_prompt_tokens + max_new_tokens may pass the positions while the real
  # prompts fit (run_guard.check_context): vLLM refuses such a max_model_len outright.
  make(dataclasses.replace(TINY, max_position_embeddings=40), max_model_len=176)
  assert stand_in.INSTANCES[0].kwargs["max_model_len"] == 40


def test_bad_options_get_one_line_each():
  c = common.base_config()
  c.rollout.vllm.update(dict(gpu_memory_utilization=1.5, sleep_level=3, max_num_seqs=0,
                             dtype="float8"))
  with pytest.raises(ValueError) as e:
    vllm_setup.VllmOptions.from_config(c)
  lines = str(e.value).splitlines()
  assert [line.split("=")[0] for line in lines] == [
      "config.rollout.vllm.gpu_memory_utilization", "config.rollout.vllm.max_num_seqs",
      "config.rollout.vllm.sleep_level", "config.rollout.vllm.dtype"]


def test_config_check_names_bad_vllm_values():
  from configs import tiny  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.training import config_check  # pylint: disable=g-import-not-at-top
  c = tiny.get_config()
  c.rollout.vllm.sleep_level = 5
  with pytest.raises(config_check.ConfigError,  # the jax engine would ignore it
                     match=r"^config.rollout.vllm.sleep_level=5: is read only with "
                           r"rollout.engine='vllm'"):
    config_check.check(c)
  c.rollout.engine = "vllm"
  with pytest.raises(config_check.ConfigError,
                     match=r"^config.rollout.vllm.sleep_level=5: must be 0"):
    config_check.check(c)


def kinds(calls):
  return [kind for kind, _ in calls if kind != "reload_weights"]


def test_sleeps_after_each_rollout_and_wakes_with_fresh_weights(stand_in):
  engine = make(TINY)
  config = sampling.SamplingConfig(max_new_tokens=4)
  first = tiny_params()
  second = jax.tree.map(lambda x: x + 0.01, first)  # as if after a learner step
  engine.generate(PROMPTS, COUNTS, first, jax.random.key(0), config)
  llm = stand_in.INSTANCES[0]
  assert kinds(llm.calls) == ["LLM", "reset_prefix_cache", "generate", "sleep"]
  del llm.calls[:]
  engine.generate(PROMPTS, COUNTS, second, jax.random.key(1), config)
  # Weights awake, all loaded, then the KV cache; generate; sleep again.
  calls = [kind for kind, _ in llm.calls]
  assert llm.calls[0] == ("wake_up", ["weights"]) and llm.calls[-4] == ("wake_up", ["kv_cache"])
  assert calls[1:-4] == ["reload_weights"]  # one reload: every tensor, one generator
  assert calls[-3:] == ["reset_prefix_cache", "generate", "sleep"] and llm.calls[-1][1] == 2
  # What vLLM generated with are the second parameters.
  for name, array in export.hf_state_dict(TINY, second, dtype="float32"):
    np.testing.assert_array_equal(llm.generated_with[name][2], array, err_msg=name)


def test_sleep_level_zero_keeps_vllm_awake_and_reloads_only_new_weights(stand_in):
  engine = make(TINY, sleep_level=0)
  params = tiny_params()
  config = sampling.SamplingConfig(max_new_tokens=4)
  for _ in range(2):
    engine.generate(PROMPTS, COUNTS, params, jax.random.key(0), config)
  llm = stand_in.INSTANCES[0]
  assert kinds(llm.calls) == ["LLM", "reset_prefix_cache", "generate", "generate"]
  assert llm.kwargs["enable_sleep_mode"] is False


def test_outputs_are_prompt_major_with_the_stand_ins_tokens(stand_in):
  engine = make(TINY)
  out = engine.generate(PROMPTS, COUNTS, tiny_params(), jax.random.key(3),
                        sampling.SamplingConfig(max_new_tokens=5))
  np.testing.assert_array_equal(out.prompt_index_N, np.repeat(np.arange(6), COUNTS))
  seeds = np.asarray(jax.random.randint(jax.random.key(3), (6,), 0, 2**31 - 1))
  first = [vllm_stand_in._token(PROMPTS[0], 0, int(seeds[0]), j, 96) for j in range(5)]
  n = int(out.lengths_N[0])
  assert list(out.tokens_NxT[0, :n]) == first[:n]
  assert out.mask_NxT.sum() == out.lengths_N.sum()


@pytest.mark.parametrize("counts,groups", [(COUNTS, 2), ([8] * 7 + [7] * 9, 8),
                                           ([0, 0, 5], 4), ([1] * 5, 2)])
def test_prompt_split_is_contiguous_balanced_and_complete(counts, groups):
  ranges = vllm_setup.split_prompts(np.array(counts), groups)
  assert ranges[0][0] == 0 and ranges[-1][1] == len(counts)
  assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
  rows = [sum(counts[a:b]) for a, b in ranges]
  assert max(rows) - min(rows) <= 2 * max(counts)
  assert vllm_setup.split_prompts(np.array([8] * 16), 8) == [(2 * g, 2 * g + 2)
                                                            for g in range(8)]


QWEN7B = models.ModelConfig(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                            intermediate_size=18944, num_layers=28, num_heads=28,
                            num_kv_heads=4, head_dim=128, tie_word_embeddings=False,
                            attention_bias=True, dtype="bfloat16")


def test_memory_splits_that_cannot_fit_are_refused_with_one_line():
  options = vllm_setup.VllmOptions(max_model_len=9216, gpu_memory_utilization=0.3)
  gpu = 80 * vllm_setup.GIB
  with pytest.raises(ValueError) as e:  # JAX's default 0.75 and vLLM's 0.3
    vllm_setup.plan_split(QWEN7B, options, gpu, jax_fraction=0.75)
  assert len(str(e.value).splitlines()) == 1 and "XLA_PYTHON_CLIENT_MEM_FRACTION" in str(e.value)
  small = vllm_setup.VllmOptions(max_model_len=9216, gpu_memory_utilization=0.15)
  with pytest.raises(ValueError) as e:  # 12 GiB cannot hold 14.2 GiB of bfloat16 weights
    vllm_setup.plan_split(QWEN7B, small, gpu, jax_fraction=None)
  assert len(str(e.value).splitlines()) == 1 and "weights (14.2 GiB" in str(e.value)
  # Split over two GPUs the weights fit; the KV cache holds whole sequences.
  split = vllm_setup.plan_split(
      QWEN7B, vllm_setup.VllmOptions(max_model_len=9216, gpu_memory_utilization=0.15,
                                     tensor_parallel_size=2), gpu, jax_fraction=None)
  assert split.kv_sequences == int((0.15 * 80 - 14.19 / 2 - 2) // (split.kv_gib_per_sequence))
  assert vllm_setup.plan_split(QWEN7B, options, gpu, jax_fraction=0.6).kv_sequences > 0
  edge = vllm_setup.VllmOptions(max_model_len=9216, gpu_memory_utilization=0.28)
  assert vllm_setup.plan_split(QWEN7B, edge, gpu, jax_fraction=0.67).kv_sequences == 12
  monkey_env = {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
  assert vllm_setup.jax_held_fraction(monkey_env) is None
  assert vllm_setup.jax_held_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}) == 0.5
  assert vllm_setup.jax_held_fraction({}) == 0.75


def test_the_cpu_kv_cache_holds_whole_blocks_of_max_num_seqs_sequences():
  per_token = 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 4  # float32
  cfg = dataclasses.replace(TINY, dtype="float32")
  one = vllm_setup.VllmOptions(max_model_len=520, max_num_seqs=1)
  plan = vllm_setup.plan_cpu_kv(cfg, one, 8 * vllm_setup.GIB, environ={})
  # 520 tokens take five 128-token blocks, and vLLM keeps one more: it refused both the
  # 520-token size and five blocks at start.
  assert plan.kv_cache_bytes == (640 + 128) * per_token and plan.kv_sequences == 1
  many = vllm_setup.VllmOptions(max_model_len=520, max_num_seqs=10**6)
  capped = vllm_setup.plan_cpu_kv(cfg, many, 8 * vllm_setup.GIB, environ={})
  assert capped.kv_cache_bytes == 128 * per_token + int(vllm_setup.CPU_KV_SHARE * 8
                                                        * vllm_setup.GIB)
  assert vllm_setup.plan_cpu_kv(cfg, one, 8 * vllm_setup.GIB, environ={
      "VLLM_CPU_KVCACHE_SPACE": "2"}).kv_cache_bytes == 2 * vllm_setup.GIB
  with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE='lots' must be a whole"):
    vllm_setup.plan_cpu_kv(cfg, one, 8 * vllm_setup.GIB, {"VLLM_CPU_KVCACHE_SPACE": "lots"})
  with pytest.raises(ValueError, match="less than one 520-token sequence.*free memory or "
                                       "shorten data.max_prompt_tokens"):
    vllm_setup.plan_cpu_kv(cfg, one, 1000, environ={})
  # Too small a size of the user's: the fix is to raise or unset it, not to free memory.
  with pytest.raises(ValueError, match=r"VLLM_CPU_KVCACHE_SPACE=0 is 0.00 GiB, less than one "
                                       r"520-token sequence .* raise VLLM_CPU_KVCACHE_SPACE "
                                       r"or unset it"):
    vllm_setup.plan_cpu_kv(cfg, one, 8 * vllm_setup.GIB, {"VLLM_CPU_KVCACHE_SPACE": "0"})


def test_the_engine_refuses_a_split_before_starting_vllm(stand_in, monkeypatch):
  monkeypatch.setattr(vllm_engine, "_device_bytes", lambda rank: 2 * vllm_setup.GIB)
  with pytest.raises(ValueError, match="gives vLLM 0.6 GiB of the 2.0 GiB GPU"):
    make(TINY)
  assert not stand_in.INSTANCES
  with pytest.raises(cli.UsageError, match="needs 2 JAX processes"):  # exit status 2
    vllm_setup.ProcessLayout.create(2, 0, 1, 1)
  with pytest.raises(ValueError, match="one GPU per process"):
    vllm_setup.ProcessLayout.create(1, 0, 2, 8)


def completion(ids, logps, finish):
  return types.SimpleNamespace(
      token_ids=ids, finish_reason=finish,
      logprobs=[{t: types.SimpleNamespace(logprob=lp), 99: types.SimpleNamespace(logprob=-9.)}
                for t, lp in zip(ids, logps)])


def test_vllm_outputs_become_a_prompt_major_rollout():
  results = [  # prompt 1 asks for 0 samples, so vLLM gets two requests
      types.SimpleNamespace(outputs=[completion([7, 8, 2], [-0.1, -0.2, -0.3], "stop"),
                                     completion([4, 4, 4, 4], [-1.0] * 4, "length")]),
      types.SimpleNamespace(outputs=[completion([6], [-0.5], "stop")]),
  ]
  config = sampling.SamplingConfig(max_new_tokens=4)
  out = vllm_engine.finish(vllm_engine.raw_rows(results, [2, 0, 1], 4, (2,), pad_id=0),
                           config, None, pad_id=0)
  np.testing.assert_array_equal(out.prompt_index_N, [0, 0, 2])
  np.testing.assert_array_equal(out.tokens_NxT, [[7, 8, 2, 0], [4, 4, 4, 4], [6, 0, 0, 0]])
  np.testing.assert_array_equal(out.lengths_N, [3, 4, 1])
  np.testing.assert_allclose(out.logprobs_NxT[0], [-0.1, -0.2, -0.3, 0.0])
  np.testing.assert_array_equal(out.truncated_N, [False, True, False])
  with pytest.raises(ValueError, match="returned 1 outputs for 2 prompts"):
    vllm_engine.raw_rows(results[:1], [2, 0, 1], 4, (2,), pad_id=0)
  greedy = vllm_engine.raw_rows(results[1:], [0, 3], 4, (2,), pad_id=0)  # one for three
  np.testing.assert_array_equal(greedy["tokens"], [[6, 0, 0, 0]] * 3)
  np.testing.assert_array_equal(greedy["prompt_index"], [1, 1, 1])
  with pytest.raises(ValueError, match="returned 2 completions for prompt 0's 3 samples"):
    vllm_engine.raw_rows(results[:1], [3], 4, (2,), pad_id=0)


def test_sampling_params_follow_the_config():
  greedy = vllm_engine.sampling_params_kwargs(
      sampling.SamplingConfig(greedy=True, temperature=0.6, max_new_tokens=9), 3, 11, (2, 5))
  assert greedy["temperature"] == 0.0 and greedy["top_k"] == -1 and greedy["stop"] is None
  # vLLM refuses n > 1 for greedy requests: one completion stands for the three.
  assert (greedy["n"], greedy["seed"], greedy["max_tokens"]) == (1, 11, 9)
  assert greedy["stop_token_ids"] == [2, 5] and greedy["logprobs"] == 0
  sampled = vllm_engine.sampling_params_kwargs(
      sampling.SamplingConfig(temperature=0.6, top_p=0.9, top_k=20, stop_strings=("</s>",)),
      1, 0, (2,))
  assert (sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (0.6, 0.9, 20)
  assert sampled["stop"] == ["</s>"] and sampled["include_stop_str_in_output"]


@pytest.mark.slow
def test_two_processes_split_the_rows_and_gather_them_in_order(stand_in):
  results = vllm_two_process_main.run()

  # One process, the same prompts and key: the reference order and values.
  engine = make(TINY)
  ref = engine.generate(PROMPTS, COUNTS, tiny_params(), jax.random.key(7),
                        sampling.SamplingConfig(max_new_tokens=5))
  ranges = vllm_setup.split_prompts(np.array(COUNTS), 2)
  for pid, r in enumerate(results):
    # tensor_parallel_size 1: a vLLM of its own in each process, no launcher.
    assert r["env"] == dict.fromkeys(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                      "MASTER_PORT"))
    assert r["backend"] is None and r["seed"] == pid
    a, b = ranges[pid]  # each process generated only its own prompts
    assert r["generated"] == [PROMPTS[i] for i in range(a, b) if COUNTS[i]]
    np.testing.assert_array_equal(r["tokens"], ref.tokens_NxT)
    np.testing.assert_array_equal(r["prompt_index"], ref.prompt_index_N)
    np.testing.assert_allclose(r["logprobs"], ref.logprobs_NxT)
    assert r["texts"] == ref.texts
    expected = list(export.hf_state_dict(TINY, tiny_params()))
    assert sorted(r["loaded"]) == sorted(n for n, _ in expected)  # whole on each process
    np.testing.assert_allclose([r["loaded_sums"][n] for n, _ in expected],
                               [a.astype(np.float64).sum() for _, a in expected], rtol=1e-6)
  assert ranges[0][1] - ranges[0][0] > 0 and ranges[1][1] - ranges[1][0] > 0


def test_tensor_parallel_groups_get_a_torch_distributed_world_each():
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.5:9000"}
  worlds = [vllm_setup.launcher_env(vllm_setup.ProcessLayout.create(2, p, 4, 1), 0, env)
            for p in range(4)]
  assert [(w["RANK"], w["WORLD_SIZE"], w["MASTER_PORT"]) for w in worlds] == [
      ("0", "2", "9001"), ("1", "2", "9001"), ("0", "2", "9002"), ("1", "2", "9002")]
  assert {w["MASTER_ADDR"] for w in worlds} == {"127.0.0.1"}  # a group is node-local
  assert vllm_setup.launcher_env(vllm_setup.ProcessLayout.create(2, 3, 4, 1), 0,
                                 {"MASTER_PORT": "7000"})["MASTER_PORT"] == "7001"
  with pytest.raises(ValueError, match="needs MASTER_PORT"):
    vllm_setup.launcher_env(vllm_setup.ProcessLayout.create(2, 0, 2, 1), 0, {})


def test_choosing_vllm_where_it_cannot_run_says_why():
  try:
    vllm_engine.check_available()
  except (ImportError, RuntimeError) as e:
    with pytest.raises(type(e), match="not installed|no CUDA|sees none"):
      sampling.make_engine("vllm", models.ModelConfig(), None)
  else:
    pytest.skip("vLLM can run here")


@pytest.mark.slow
def test_the_trainer_runs_every_jax_phase_while_vllm_sleeps(stand_in, monkeypatch, tmp_path):
  from configs import tiny  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.training import learner  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.training import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  c = tiny.get_config()
  c.rollout.engine = "vllm"
  c.reward.plugins, c.reward.name = "tests.reward_plugins", "test_even_length"
  train_step = learner.train_step

  def logged_train_step(*args, **kwargs):
    stand_in.INSTANCES[0].calls.append(("learner", None))
    return train_step(*args, **kwargs)
  monkeypatch.setattr(learner, "train_step", logged_train_step)
  run = trainer_lib.Trainer(c, str(tmp_path))
  llm = stand_in.INSTANCES[0]
  assert llm.kwargs["max_model_len"] == 192 + 16
  run.train_step()
  cfg = run.state.model_cfg  # the learner donates its params: take them as HF tensors now
  after_first = list(export.hf_state_dict(cfg, run.state.params, dtype=cfg.dtype))
  run.train_step()
  order = [(k, d) for k, d in llm.calls if k in ("generate", "sleep", "wake_up", "learner")]
  order = [k if k != "wake_up" else f"wake_up {d[0]}" for k, d in order]
  assert order == ["generate", "sleep", "learner", "learner", "wake_up weights",
                   "wake_up kv_cache", "generate", "sleep", "learner", "learner"]
  # The second rollout ran on the weights the first learner phase produced.
  for name, array in after_first:
    np.testing.assert_array_equal(llm.generated_with[name][2], array, err_msg=name)


def test_vllm_console_keeps_warnings_a_user_can_act_on(capsys, monkeypatch):
  environ = {}
  logger = logging.getLogger("vllm")
  monkeypatch.setattr(logger, "handlers", [])
  monkeypatch.setattr(logger, "propagate", True)
  vllm_console.quiet(environ)
  vllm_console.quiet(environ)  # a second engine adds no second handler
  assert environ == {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CONFIGURE_LOGGING": "0"}
  worker = logging.getLogger("vllm.v1.worker.cpu_worker")
  worker.warning("libtcmalloc is not found in LD_PRELOAD. For best performance, ...")
  worker.warning("CPU backend doesn't allow to use `torch.set_num_threads` after the thread "
                 "binding, skip it.")
  worker.warning("KV cache is only 3 percent full")
  worker.info("Loading weights took 0.1 s")
  logging.getLogger("torch._library.triton").warning("Triton not available, kernels = []")
  assert capsys.readouterr().err.splitlines() == [
      "[vllm] WARNING KV cache is only 3 percent full"]
  asked = {"VLLM_CONFIGURE_LOGGING": "1"}  # vLLM's own console setup: left alone
  monkeypatch.setattr(logger, "handlers", [])
  vllm_console.quiet(asked)
  assert not logger.handlers
