"""The JAX rollout engine on a tiny random model: log-probs, entropy, padding, EOS, keys.

References are independent of the sampler: teacher-forced `models.apply` over
prompt + response in one forward (no cache), and NumPy softmax/entropy.
"""

import dataclasses

import jax
import numpy as np
import pytest
from scipy import special

from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax.sampling import decode

MAX_NEW = 12
PROMPTS = [[5, 6, 7], list(range(20, 37)), [3, 9, 4, 11, 2, 8, 30, 31, 40]]
# Most calls share this config and 3 prompts, so the tests compile few programs.
BASE = sampling.SamplingConfig(max_new_tokens=MAX_NEW, return_entropy=True)
GREEDY = dataclasses.replace(BASE, greedy=True)


def tiny_model(eos=(1,)):
  cfg = models.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                           tie_word_embeddings=False, eos_token_id=eos, pad_token_id=0)
  params = models.init_params(cfg, jax.random.key(0))
  # Logit spread ~1.6 nats: varied, non-degenerate next-token distributions.
  params["lm_head"] = params["lm_head"] * 10
  return cfg, params


@pytest.fixture(scope="module")
def tiny():
  cfg, params = tiny_model()
  return cfg, params, sampling.make_engine("jax", cfg, None)


def teacher_forced(cfg, params, prompts, responses, temperature=1.0):
  """Per row: log_softmax(logits / T) of each response token and the full entropy.

  One right-padded forward of prompt + response for all rows (no cache)."""
  rows = [list(p) + list(r) for p, r in zip(prompts, responses)]
  ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
  valid = np.zeros(ids.shape, bool)
  for i, row in enumerate(rows):
    ids[i, :len(row)], valid[i, :len(row)] = row, True
  logits = np.asarray(jax.jit(models.apply, static_argnums=0)(cfg, params, ids, valid)[0])
  out = []
  for i, (p, r) in enumerate(zip(prompts, responses)):
    logp = special.log_softmax(logits[i, len(p) - 1:len(p) - 1 + len(r)] / temperature, -1)
    out.append((logp[np.arange(len(r)), r], -(np.exp(logp) * logp).sum(-1)))
  return out


@pytest.mark.parametrize("config", [
    BASE, dataclasses.replace(BASE, temperature=0.7, top_p=0.9, top_k=20),
], ids=["T1", "T0.7-topk-topp"])
def test_logprobs_and_entropy_equal_teacher_forced(tiny, config):
  cfg, params, engine = tiny
  out = engine.generate(PROMPTS, [2, 1, 3], params, jax.random.key(3), config)
  np.testing.assert_array_equal(out.prompt_index_N, [0, 0, 1, 2, 2, 2])
  assert (out.lengths_N > 1).all()
  responses = [out.tokens_NxT[r, :n] for r, n in enumerate(out.lengths_N)]
  reference = teacher_forced(cfg, params, [PROMPTS[i] for i in out.prompt_index_N],
                             responses, config.temperature)
  for r, (logp, entropy) in enumerate(reference):
    length = out.lengths_N[r]
    np.testing.assert_allclose(out.logprobs_NxT[r, :length], logp, atol=1e-5)
    np.testing.assert_allclose(out.entropy_NxT[r, :length], entropy, atol=1e-4)
    assert not out.logprobs_NxT[r, length:].any() and not out.entropy_NxT[r, length:].any()


def test_qwen2_attention_biases_are_applied_in_decode():
  """The decode loop's own layer (`decode_layer`) adds q/k/v biases as the model does."""
  cfg, params = tiny_model()
  cfg = dataclasses.replace(cfg, attention_bias=True)
  params = models.init_params(cfg, jax.random.key(0)) | {"lm_head": params["lm_head"]}
  attn = params["layers"]["attn"]
  for i, name in enumerate(("q_proj_bias", "k_proj_bias", "v_proj_bias")):
    attn[name] = jax.random.normal(jax.random.key(i), attn[name].shape)
  out = sampling.make_engine("jax", cfg, None).generate(PROMPTS, 1, params,
                                                       jax.random.key(5), BASE)
  responses = [out.tokens_NxT[r, :n] for r, n in enumerate(out.lengths_N)]
  for r, (logp, entropy) in enumerate(teacher_forced(cfg, params, PROMPTS, responses)):
    np.testing.assert_allclose(out.logprobs_NxT[r, :out.lengths_N[r]], logp, atol=1e-5)
    np.testing.assert_allclose(out.entropy_NxT[r, :out.lengths_N[r]], entropy, atol=1e-4)


def test_greedy_is_independent_of_batch_neighbours(tiny):
  cfg, params, engine = tiny
  alone = engine.generate([PROMPTS[0], [7], [8]], 1, params, jax.random.key(0), GREEDY)
  longer = list(range(1, 100))  # pushes the prompt bucket from 16 to 112
  for batch in ([PROMPTS[0], longer, [7]], [[7], longer, PROMPTS[0]]):
    out = engine.generate(batch, 1, params, jax.random.key(5), GREEDY)
    row = batch.index(PROMPTS[0])
    np.testing.assert_array_equal(out.tokens_NxT[row], alone.tokens_NxT[0])
    np.testing.assert_allclose(out.logprobs_NxT[row], alone.logprobs_NxT[0], atol=1e-5)
  # Greedy means argmax of the model's next-token logits at every step.
  response = alone.tokens_NxT[0, :alone.lengths_N[0]]
  logits, _ = models.apply(cfg, params, np.array([PROMPTS[0] + list(response)], np.int32))
  np.testing.assert_array_equal(np.argmax(logits[0, len(PROMPTS[0]) - 1:-1], -1), response)


def test_same_key_same_output_whatever_the_batch(tiny):
  _, params, engine = tiny
  a = engine.generate(PROMPTS, [2, 1, 3], params, jax.random.key(7), BASE)
  b = engine.generate(PROMPTS, [2, 1, 3], params, jax.random.key(7), BASE)
  np.testing.assert_array_equal(b.tokens_NxT, a.tokens_NxT)
  # Rows 0-2 again, in a smaller batch (other bucket): the same draws.
  head = engine.generate(PROMPTS[:2], [2, 1], params, jax.random.key(7), BASE)
  np.testing.assert_array_equal(head.tokens_NxT, a.tokens_NxT[:3])
  np.testing.assert_allclose(head.logprobs_NxT, a.logprobs_NxT[:3], atol=1e-6)
  other = engine.generate(PROMPTS, [2, 1, 3], params, jax.random.key(8), BASE)
  assert (other.tokens_NxT != a.tokens_NxT).any()
  assert (a.tokens_NxT[0] != a.tokens_NxT[1]).any()  # two samples, two draws


def test_phased_cache_gives_the_same_rollouts(tiny):
  """Growing the cache in phases (long rollouts do, `decode.phases_for`) changes nothing
  but speed, also when phases end mid-sequence or every row stops in the first one."""
  cfg, params, engine = tiny
  assert decode.phases_for(MAX_NEW) == 1 and decode.phases_for(8192) > 1
  eos_cfg = dataclasses.replace(cfg, eos_token_id=(int(
      engine.generate([[7]], 1, params, jax.random.key(0), GREEDY).tokens_NxT[0, 1]),))
  cases = [(cfg, BASE, jax.random.key(7)), (cfg, GREEDY, jax.random.key(0)),
           (eos_cfg, GREEDY, jax.random.key(0))]
  for model_cfg, config, key in cases:
    one, phased = [  # 12 steps in 5 phases: 3, 2, 3, 2, 2
        sampling.make_engine("jax", model_cfg, None, cache_phases=phases).generate(
            PROMPTS + [[7]], [2, 1, 3, 1], params, key, config) for phases in (1, 5)]
    np.testing.assert_array_equal(phased.tokens_NxT, one.tokens_NxT)
    np.testing.assert_array_equal(phased.lengths_N, one.lengths_N)
    np.testing.assert_allclose(phased.logprobs_NxT, one.logprobs_NxT, atol=1e-6)
    np.testing.assert_allclose(phased.entropy_NxT, one.entropy_NxT, atol=1e-5)
  assert one.lengths_N[-1] == 2  # the EOS case did stop early


def test_max_rows_splits_whole_prompts(tiny):
  cfg, _, _ = tiny
  engine = sampling.make_engine("jax", cfg, None, max_rows=3)
  chunks = engine._split(np.array([2, 1, 3, 0, 1]))  # pylint: disable=protected-access
  assert [c.tolist() for c in chunks] == [[0, 1, 2], [3, 4, 5], [6]]
  with pytest.raises(ValueError, match="asks for 4 samples but max_rows=3"):
    engine._split(np.array([1, 4]))  # pylint: disable=protected-access


def test_eos_ends_a_row_and_is_kept_in_the_mask(tiny):
  cfg, params, engine = tiny
  free = engine.generate([PROMPTS[0], [7], [8]], 1, params, jax.random.key(0), GREEDY)
  eos = int(free.tokens_NxT[1, 3])  # row 1 emits it at step 3 (or earlier)
  eos_cfg = dataclasses.replace(cfg, eos_token_id=(eos,))
  out = sampling.make_engine("jax", eos_cfg, None).generate(
      [PROMPTS[0], [7], [8]], 1, params, jax.random.key(0), GREEDY)
  for r in range(3):
    hits = np.flatnonzero(free.tokens_NxT[r] == eos)
    length = hits[0] + 1 if hits.size else MAX_NEW
    assert out.lengths_N[r] == length
    np.testing.assert_array_equal(out.tokens_NxT[r, :length], free.tokens_NxT[r, :length])
    np.testing.assert_array_equal(out.mask_NxT[r], np.arange(MAX_NEW) < length)
    assert (out.tokens_NxT[r, length:] == 0).all()  # the pad id
    assert out.truncated_N[r] == (not hits.size)
  assert out.lengths_N[1] <= 4 and out.tokens_NxT[1, out.lengths_N[1] - 1] == eos


def test_counts_per_prompt_and_empty_requests(tiny):
  _, params, engine = tiny
  out = engine.generate(PROMPTS, [0, 2, 1], params, jax.random.key(1), BASE)
  np.testing.assert_array_equal(out.prompt_index_N, [1, 1, 2])
  assert out.tokens_NxT.shape == (3, MAX_NEW) and len(out.texts) == 3
  empty = engine.generate(PROMPTS, 0, params, jax.random.key(1), BASE)
  assert empty.tokens_NxT.shape == (0, MAX_NEW) and empty.texts == []


def test_new_params_and_batch_sizes_in_a_bucket_do_not_recompile(tiny):
  _, params, engine = tiny
  engine.generate(PROMPTS, [2, 1, 3], params, jax.random.key(0), BASE)
  compiles = engine.stats["compiles"]
  shifted = jax.tree.map(lambda x: x * 1.01, params)
  engine.generate(PROMPTS, [1, 2, 4], shifted, jax.random.key(1), BASE)  # 7 rows -> 8
  engine.generate(PROMPTS, 2, params, jax.random.key(2),
                  dataclasses.replace(BASE, temperature=0.5))  # traced temperature
  engine.generate(PROMPTS, 2, params, jax.random.key(2), GREEDY)  # traced greedy switch
  assert engine.stats["compiles"] == compiles


def test_the_static_loop_holds_no_copy_of_the_layers_as_a_temporary():
  """The decode weights are prepared by a program of their own: inside the static loop's
  they were one more temporary, which on CPU is fresh memory to fault in on every call
  (112k page faults and 0.15-0.28 s of system time per SmolLM2 call at batch 8)."""
  cfg = dataclasses.replace(tiny_model()[0], hidden_size=512, intermediate_size=1024)
  params = models.init_params(cfg, jax.random.key(0))
  engine = sampling.make_engine("jax", cfg, None, scheduler="static")
  engine.generate(PROMPTS, 2, params, jax.random.key(0), BASE)
  layers = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
  memory = engine.stats["memory"]
  assert memory["temp"] < layers / 4, (memory, layers)
  assert memory["argument"] >= layers, (memory, layers)


def test_a_programs_memory_is_read_when_it_compiles_not_on_every_call(tiny, monkeypatch):
  """`memory_analysis` costs ~40 ms a call on CPU (a tenth of a 16-step decode chunk): the
  engine reads it once per compiled program, and reports it on every call."""
  cfg, params, _ = tiny
  reads = []
  analyse = jax.stages.Compiled.memory_analysis
  monkeypatch.setattr(jax.stages.Compiled, "memory_analysis",
                      lambda self: reads.append(1) or analyse(self))
  for engine in (sampling.make_engine("jax", cfg, None),  # the static loop
                 sampling.make_engine("jax", cfg, None, max_rows=2)):  # 4 rows: continuous
    engine.generate(PROMPTS, [2, 1, 1], params, jax.random.key(0), BASE)
    compiled = len(reads)
    assert compiled == engine.stats["compiles"] > 0
    engine.stats["memory"] = {}
    engine.generate(PROMPTS, [2, 1, 1], params, jax.random.key(1), BASE)
    assert len(reads) == compiled and engine.stats["memory"]["argument"] > 0
    reads.clear()


@pytest.mark.parametrize("prompts,n,message", [
    ([[1, 2], []], 1, r"prompt_ids\[1\] is empty"),
    ([[1, 2], [3]], [1, 2, 3], "3 counts for 2 prompts"),
    ([[1, 2], [3]], [1, -1], r"n\[1\] = -1"),
])
def test_bad_requests_are_named(tiny, prompts, n, message):
  _, params, engine = tiny
  with pytest.raises(ValueError, match=message):
    engine.generate(prompts, n, params, jax.random.key(0), sampling.SamplingConfig())


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(stop_strings="###"), "stop_strings"),
])
def test_bad_sampling_configs_are_named(kwargs, message):
  with pytest.raises(ValueError, match=message):
    sampling.SamplingConfig(**kwargs)


def test_a_program_compiled_at_one_matmul_precision_is_not_reused_at_another(tiny):
  """The engine's own cache of compiled programs keys on JAX's matmul precision, as jit's
  does: a float32 run at `highest` (model.matmul_precision auto) must not get a TF32
  program compiled earlier in the process."""
  _, params, engine = tiny
  calls = []
  for precision in ("highest", "high", "high"):
    before = engine.stats["compiles"]
    with jax.default_matmul_precision(precision):
      engine.generate(PROMPTS, 1, params, jax.random.key(0), GREEDY)
    calls.append(engine.stats["compiles"] - before)
  assert calls[1] > 0 and calls[2] == 0, calls
