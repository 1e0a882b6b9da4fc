r"""Records prompt and response lengths of real SmolLM2 rollouts on GSM8K prompts.

Its record (docs/results/smollm2_gsm8k_rollout_lengths.json) is the `--lengths` input of
`python -m exgrpo_jax.aot plan --estimate` (docs/aot.md, "Your own config") and of
bench_packing.py (docs/algorithm.md §12).

  python scripts/bench/record_rollout_lengths.py --questions=16 --k=4 --max-new-tokens=512 \
      --out=docs/results/smollm2_gsm8k_rollout_lengths.json

The embedded SmolLM2-135M-Instruct samples `--k` responses (temperature 1, the
training rollout's sampling) to each of the first `--questions` GSM8K training
questions, rendered as configs/smollm2_135m.py renders them. Writes JSON: per rollout
the prompt and response token counts and whether it hit the cap; scripts/bench/bench_packing.py
replays these lengths.
"""

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from configs import smollm2_135m  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import data  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import eval as eval_cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from exgrpo_jax import sampling  # pylint: disable=g-import-not-at-top,wrong-import-position


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--questions", type=int, default=16)
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--max-new-tokens", type=int, default=512)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  config = smollm2_135m.get_config()
  cfg, params, tokenizer = eval_cli.load_model("", "float32")
  questions = data.load_questions(config.data.train_path, limit=args.questions).questions
  prompts, _ = data.render_prompts(questions, tokenizer, template=config.data.template,
                                   max_prompt_tokens=config.data.max_prompt_tokens)
  engine = sampling.make_engine("jax", cfg, tokenizer)
  start = time.perf_counter()
  out = engine.generate([list(p.ids) for p in prompts], args.k, params,
                        jax.random.key(args.seed),
                        sampling.SamplingConfig(max_new_tokens=args.max_new_tokens))
  prompt_lens = [len(prompts[int(i)].ids) for i in out.prompt_index_N]
  response_lens = [int(n) for n in out.lengths_N]
  result = dict(
      model="SmolLM2-135M-Instruct (embedded)", data=os.path.basename(config.data.train_path),
      template=config.data.template, questions=len(prompts), k=args.k,
      max_new_tokens=args.max_new_tokens, temperature=1.0, seed=args.seed,
      seconds=round(time.perf_counter() - start, 1),
      response_mean=float(np.mean(response_lens)), prompt_mean=float(np.mean(prompt_lens)),
      truncated=int(np.sum(out.truncated_N)),
      prompt_lens=prompt_lens, response_lens=response_lens)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps({k: v for k, v in result.items() if not k.endswith("_lens")}))


if __name__ == "__main__":
  main()
