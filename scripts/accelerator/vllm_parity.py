"""The vLLM engine against the JAX engine and the float32 learner, as JSON figures.

Shown in docs/vllm.md (docs/results/vllm_parity_{float32,bfloat16}.json).

  python scripts/accelerator/vllm_parity.py                   # vLLM in float32
  python scripts/accelerator/vllm_parity.py --dtype bfloat16  # vLLM in bfloat16, learner float32

On the embedded SmolLM2-135M-Instruct (or --model), float32 parameters, chat prompts of
the arithmetic task's held-out questions, one vLLM engine in this process (vLLM's CPU build or
CUDA), for the parameters as loaded and scaled by 1.05 (a change that moves greedy
output, so each row set after the first needs a weight reload):
* greedy: rows token-identical to the JAX engine's (float32), and the log-probs of vLLM's
  tokens against the learner's teacher-forced log_softmax(logits) at T = 1;
* sampled (--samples per prompt at --temperature): the same log-prob differences at T,
  and the rollout/learner mismatch as truncated importance sampling sees it (docs/
  algorithm.md): mean |learner - rollout|, the largest ratio exp(learner - rollout) and
  the share of tokens whose ratio exceeds --tis-cap.
Every difference is over valid response tokens. vLLM starts without torch.compile.
"""

import argparse
import json
import sys

import jax
import numpy as np

from exgrpo_jax import generate
from exgrpo_jax import logprobs
from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax.data import arithmetic
from exgrpo_jax.sampling import vllm_setup


def learner_logprobs(cfg, params, prompts, out, temperature):
  """The float32 learner's log-probs of each row's response tokens, [N, T] like `out`."""
  rows = [list(prompts[i]) + list(out.tokens_NxT[r, :n])
          for r, (i, n) in enumerate(zip(out.prompt_index_N, out.lengths_N))]
  ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
  valid = np.zeros(ids.shape, bool)
  for r, row in enumerate(rows):
    ids[r, :len(row)], valid[r, :len(row)] = row, True
  logp_BxT, _ = jax.jit(logprobs.sequence_logprobs, static_argnums=0,
                        static_argnames=("temperature", "compute_entropy"))(
      cfg, params, ids, valid, temperature=temperature, compute_entropy=False)
  logp_BxT = np.asarray(logp_BxT)
  result = np.zeros(out.logprobs_NxT.shape, np.float32)
  for r, (i, n) in enumerate(zip(out.prompt_index_N, out.lengths_N)):
    start = len(prompts[i])
    result[r, :n] = logp_BxT[r, start:start + n]
  return result


def differences(learner, out, cap):
  """Mismatch statistics of `out`'s log-probs against the learner's, valid tokens."""
  log_ratio = (learner - out.logprobs_NxT)[out.mask_NxT]
  return dict(tokens=int(log_ratio.size), mean_abs=float(np.abs(log_ratio).mean()),
              max_abs=float(np.abs(log_ratio).max()),
              max_ratio=float(np.exp(log_ratio.max())),
              share_above_cap=float((np.exp(log_ratio) > cap).mean()))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="", help="HF dir or .gguf (default: embedded SmolLM2)")
  p.add_argument("--dtype", default="float32", help="vLLM's compute dtype (rollout.vllm.dtype)")
  p.add_argument("--prompts", type=int, default=24)
  p.add_argument("--samples", type=int, default=4)
  p.add_argument("--temperature", type=float, default=0.7)
  p.add_argument("--new-tokens", type=int, default=48)
  p.add_argument("--tis-cap", type=float, default=2.0)
  args = p.parse_args(argv)
  policy = models.from_pretrained(args.model or None)
  tokenizer = models.load_tokenizer(args.model or None)
  questions = arithmetic.make_questions(arithmetic.ArithmeticSettings(), "eval",
                                       limit=args.prompts)
  prompts = [generate.encode(tokenizer, q.messages[-1]["content"], chat=True)
             for q in questions]
  jax_engine = sampling.make_engine("jax", policy.config, tokenizer)
  vllm = sampling.make_engine(
      "vllm", policy.config, tokenizer, options=vllm_setup.VllmOptions(
          max_model_len=max(map(len, prompts)) + args.new_tokens, sleep_level=0,
          enforce_eager=True, dtype=args.dtype))
  greedy = sampling.SamplingConfig(greedy=True, max_new_tokens=args.new_tokens)
  sampled = sampling.SamplingConfig(temperature=args.temperature,
                                    max_new_tokens=args.new_tokens)
  result = dict(model=args.model or "SmolLM2-135M-Instruct (embedded)", learner="float32",
                vllm_dtype=args.dtype, platform=vllm.platform, prompts=len(prompts),
                new_tokens=args.new_tokens, parameters={})
  for name, scale in (("as loaded", 1.0), ("scaled by 1.05", 1.05)):
    params = jax.tree.map(lambda x: x * scale, policy.params)  # pylint: disable=cell-var-from-loop
    print(f"[vllm_parity] {name}: greedy and sampled rows", file=sys.stderr, flush=True)
    ours = jax_engine.generate(prompts, 1, params, jax.random.key(0), greedy)
    theirs = vllm.generate(prompts, 1, params, jax.random.key(0), greedy)
    rows = vllm.generate(prompts, args.samples, params, jax.random.key(1), sampled)
    result["parameters"][name] = dict(
        greedy_rows_identical=int(sum((a == b).all() for a, b in
                                      zip(ours.tokens_NxT, theirs.tokens_NxT))),
        greedy_rows=len(prompts),
        greedy_logprobs_vs_learner=differences(
            learner_logprobs(policy.config, params, prompts, theirs, 1.0), theirs,
            args.tis_cap),
        sampled_rows=int(len(rows.lengths_N)), temperature=args.temperature,
        sampled_logprobs_vs_learner=differences(
            learner_logprobs(policy.config, params, prompts, rows, args.temperature), rows,
            args.tis_cap))
  vllm.close()
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
