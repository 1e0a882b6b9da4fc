"""The JAX sampler on the real SmolLM2-135M-Instruct (fp32) against independent references.

* greedy decoding is token-identical to transformers' greedy `generate`;
* per-token log-probs equal the learner's teacher-forced log_softmax(logits / T) of the
  same tokens (one `models.apply` forward over prompt + response, no cache).

The five chat prompts are decoded in one padded batch, so padding is exercised too. Both
tests share one compiled program (temperature and greedy are traced).
"""

import jax
import numpy as np
import pytest

from exgrpo_jax import generate
from exgrpo_jax import models
from exgrpo_jax import sampling

from tests import sampler_test

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MAX_NEW = 48
QUESTIONS = [
    "What is 12 + 35?",
    "Name three primary colors.",
    "A train travels 60 km in 1.5 hours. What is its average speed?",
    "Write one sentence about the ocean.",
    "If x + 3 = 10, what is x? Explain briefly.",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_hf_dir):
  policy = models.from_pretrained()
  tokenizer = models.load_tokenizer()
  prompts = [generate.encode(tokenizer, q, chat=True) for q in QUESTIONS]
  engine = sampling.make_engine("jax", policy.config, tokenizer)
  return policy, tokenizer, prompts, engine, smollm2_hf_dir


def test_greedy_matches_transformers_generate(smollm2):
  policy, tokenizer, prompts, engine, hf_dir = smollm2
  out = engine.generate(prompts, 1, policy.params, jax.random.key(0),
                        sampling.SamplingConfig(greedy=True, max_new_tokens=MAX_NEW))
  hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  for i, ids in enumerate(prompts):
    with torch.no_grad():
      full = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=int),
                         max_new_tokens=MAX_NEW, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    expected = full[0, len(ids):].tolist()
    ours = out.tokens_NxT[i, :out.lengths_N[i]].tolist()
    assert ours == expected, (i, tokenizer.decode(ours), tokenizer.decode(expected))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_teacher_forced(smollm2, temperature):
  policy, _, prompts, engine, _ = smollm2
  out = engine.generate(prompts, 1, policy.params, jax.random.key(1),
                        sampling.SamplingConfig(temperature=temperature,
                                                max_new_tokens=MAX_NEW))
  responses = [out.tokens_NxT[i, :n] for i, n in enumerate(out.lengths_N)]
  reference = sampler_test.teacher_forced(policy.config, policy.params, prompts, responses,
                                          temperature)
  for i, (logp, _) in enumerate(reference):
    np.testing.assert_allclose(out.logprobs_NxT[i, :len(logp)], logp, atol=1e-4)
