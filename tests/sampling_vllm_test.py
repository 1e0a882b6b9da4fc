"""The vLLM engine's parts that run without vLLM, and an end-to-end test gated on it.

vLLM's `load_weights` takes checkpoint (HF) names and layouts, so the weight hand-off is
checked by loading the streamed chunks into a transformers model and comparing logits.
"""

import json
import types

import jax
import numpy as np
import pytest

from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax.sampling import vllm_engine

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_weight_chunks_load_into_transformers_with_identical_logits(tmp_path):
  torch.manual_seed(0)
  hf_cfg = transformers.Qwen2Config(  # biases and an untied head: every layout
      vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
  source = transformers.Qwen2ForCausalLM(hf_cfg).float()
  with torch.no_grad():
    for p in source.parameters():
      p.copy_(0.1 * torch.randn_like(p))
  source.save_pretrained(tmp_path)
  policy = models.from_pretrained(str(tmp_path))

  chunks = list(vllm_engine.weight_chunks(policy.config, policy.params, max_bytes=20_000))
  names = [name for chunk in chunks for name, _ in chunk]
  assert len(chunks) > 1 and len(names) == len(set(names))
  target = transformers.Qwen2ForCausalLM(hf_cfg).float().eval()
  expected = {k for k in target.state_dict() if not k.endswith("rotary_emb.inv_freq")}
  assert set(names) == expected
  target.load_state_dict({n: torch.from_numpy(a) for c in chunks for n, a in c}, strict=False)

  ids = np.random.default_rng(0).integers(0, 96, (2, 11))
  with torch.no_grad():
    hf_logits = target(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(policy(ids)), hf_logits, atol=1e-5)


def test_sampling_params_follow_the_config():
  greedy = vllm_engine.sampling_params_kwargs(
      sampling.SamplingConfig(greedy=True, temperature=0.6, max_new_tokens=9), 3, 11, (2, 5))
  assert greedy["temperature"] == 0.0 and greedy["top_k"] == -1 and greedy["stop"] is None
  assert (greedy["n"], greedy["seed"], greedy["max_tokens"]) == (3, 11, 9)
  assert greedy["stop_token_ids"] == [2, 5] and greedy["logprobs"] == 0
  sampled = vllm_engine.sampling_params_kwargs(
      sampling.SamplingConfig(temperature=0.6, top_p=0.9, top_k=20, stop_strings=("</s>",)),
      1, 0, (2,))
  assert (sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (0.6, 0.9, 20)
  assert sampled["stop"] == ["</s>"] and sampled["include_stop_str_in_output"]


def completion(ids, logps, finish):
  return types.SimpleNamespace(
      token_ids=ids, finish_reason=finish,
      logprobs=[{t: types.SimpleNamespace(logprob=lp), 99: types.SimpleNamespace(logprob=-9.)}
                for t, lp in zip(ids, logps)])


def test_vllm_outputs_become_a_prompt_major_rollout():
  eos = (2,)
  results = [  # prompt 1 asks for 0 samples, so vLLM gets two requests
      types.SimpleNamespace(outputs=[completion([7, 8, 2], [-0.1, -0.2, -0.3], "stop"),
                                     completion([4, 4, 4, 4], [-1.0] * 4, "length")]),
      types.SimpleNamespace(outputs=[completion([6], [-0.5], "stop")]),
  ]
  config = sampling.SamplingConfig(max_new_tokens=4)
  out = vllm_engine.to_rollout(results, [2, 0, 1], config, eos, None, pad_id=0)
  np.testing.assert_array_equal(out.prompt_index_N, [0, 0, 2])
  np.testing.assert_array_equal(out.tokens_NxT, [[7, 8, 2, 0], [4, 4, 4, 4], [6, 0, 0, 0]])
  np.testing.assert_array_equal(out.lengths_N, [3, 4, 1])
  np.testing.assert_array_equal(out.mask_NxT.sum(1), [3, 4, 1])
  np.testing.assert_allclose(out.logprobs_NxT[0], [-0.1, -0.2, -0.3, 0.0])
  np.testing.assert_allclose(out.logprobs_NxT[2], [-0.5, 0, 0, 0])
  # Row 2 stopped on a stop token that is not EOS; only row 1 ran out of tokens.
  np.testing.assert_array_equal(out.truncated_N, [False, True, False])
  with pytest.raises(ValueError, match="returned 1 outputs for 2 prompts"):
    vllm_engine.to_rollout(results[:1], [2, 0, 1], config, eos, None, pad_id=0)


def test_memory_split_is_checked_when_jax_owns_a_gpu(monkeypatch):
  monkeypatch.setattr(vllm_engine.jax, "devices",
                      lambda: [types.SimpleNamespace(platform="gpu")])
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
  with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
    vllm_engine.check_memory_split(0.3)
  vllm_engine.check_memory_split(0.2)  # 0.75 + 0.2 fits
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  vllm_engine.check_memory_split(0.9)


def test_choosing_vllm_where_it_cannot_run_says_why():
  try:
    vllm_engine.check_available()
  except (ImportError, RuntimeError) as e:
    with pytest.raises(type(e), match="not installed|no CUDA|sees none"):
      sampling.make_engine("vllm", models.ModelConfig(), None)
  else:
    pytest.skip("vLLM can run here")


def test_vllm_greedy_matches_the_jax_engine():
  pytest.importorskip("vllm")
  if not torch.cuda.is_available():
    pytest.skip("vLLM needs a CUDA GPU")
  policy, tokenizer = models.from_pretrained(), models.load_tokenizer()
  prompts = [tokenizer("The capital of France is")["input_ids"], [1, 2, 3, 4]]
  config = sampling.SamplingConfig(greedy=True, max_new_tokens=16)
  outs = [sampling.make_engine(name, policy.config, tokenizer).generate(
      prompts, 1, policy.params, jax.random.key(0), config) for name in ("jax", "vllm")]
  np.testing.assert_array_equal(outs[0].tokens_NxT, outs[1].tokens_NxT)
  np.testing.assert_allclose(outs[0].logprobs_NxT, outs[1].logprobs_NxT, atol=1e-3)
  assert json.dumps(outs[0].texts) == json.dumps(outs[1].texts)
