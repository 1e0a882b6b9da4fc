r"""Starting accuracy of the embedded SmolLM2 on the arithmetic task, per difficulty (JSON).

Shown in docs/data.md (how hard the generated arithmetic is for the CPU model).

  python scripts/bench/calibrate_arithmetic.py --questions 48 --samples 2 --max-new-tokens 48 \
      --temperatures 0,0.7,1 --setting "operations=add,sub;max_operand=9;train_size=150"

For every `--setting` (`;`-separated ArithmeticSettings fields, `ArithmeticSettings.parse`)
it evaluates the first `--questions` training questions at each of `--temperatures`
(0 = greedy; `--samples` per question otherwise) with the training template and reward,
and prints one JSON line each: accuracy overall and per operation, mean response length,
truncated fraction. RLVR learns best where the accuracy at the rollout temperature is
between about 25% and 60%: groups of K then often mix solved and unsolved rollouts.
"""

import argparse
import dataclasses
import json
import time

import jax

from exgrpo_jax import evaluation
from exgrpo_jax import models
from exgrpo_jax import rewards
from exgrpo_jax import sampling
from exgrpo_jax.data import arithmetic


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--setting", action="append", default=[],
                      help="ArithmeticSettings fields, e.g. 'operations=add;digits=2'")
  parser.add_argument("--questions", type=int, default=48)
  parser.add_argument("--samples", type=int, default=1, help="samples per question at T > 0")
  parser.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy")
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--split", default="train", choices=arithmetic.SPLITS)
  args = parser.parse_args()
  policy = models.from_pretrained(None, dtype="float32")
  tokenizer = models.load_tokenizer(None)
  engine = sampling.make_engine("jax", policy.config, tokenizer)
  with rewards.RewardPool(num_workers=1) as pool:
    for text in args.setting or [""]:
      settings = arithmetic.ArithmeticSettings.parse(text)
      questions = arithmetic.make_questions(settings, args.split, limit=args.questions)
      for temperature in map(float, args.temperatures.split(",")):
        n = args.samples if temperature > 0 else 1
        start = time.perf_counter()
        result = evaluation.evaluate(
            engine, policy.params, tokenizer, questions,
            sampling.SamplingConfig(temperature=temperature, greedy=temperature == 0,
                                    max_new_tokens=args.max_new_tokens),
            pool, jax.random.key(0), evaluation.EvalOptions(remove_system=False, n=n))
        print(json.dumps(dict(
            setting=dataclasses.asdict(settings), temperature=temperature,
            samples_per_question=n,
            questions=len(questions), max_new_tokens=args.max_new_tokens,
            accuracy=round(result["overall"]["avg@k"], 3),
            per_operation={k: round(v["avg@k"], 3) for k, v in result["per_source"].items()},
            mean_length=round(result["overall"]["mean_response_length"], 1),
            truncated=round(sum(v["truncated_frac"] for v in result["per_source"].values())
                            / len(result["per_source"]), 3),
            seconds=round(time.perf_counter() - start, 1))), flush=True)


if __name__ == "__main__":
  main()
