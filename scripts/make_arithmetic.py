r"""Writes the small-scale study's task: integer arithmetic with exact answers, as JSONL.

  python scripts/make_arithmetic.py --out runs/data/arith     # train.jsonl, test.jsonl

Each row is `{"problem", "answer", "data_source": "arith_<op>"}`; the data loader appends
the \boxed{} instruction and grades with Math-Verify. Problems mix two-operand sums,
differences, products and three-operand expressions, so SmolLM2-135M-Instruct starts
low but not at zero (docs/results.md measures it). Train and test are disjoint: a
problem text is never in both. The output is a pure function of `--seed`.
"""

import argparse
import json
import os
import random

OPERATIONS = ("add", "sub", "mul", "mixed")


def make_problem(rng: random.Random, op: str) -> tuple[str, int]:
  """One problem text and its integer answer."""
  if op == "add":
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a} + {b}?", a + b
  if op == "sub":
    a, b = rng.randint(20, 99), rng.randint(10, 99)
    return f"What is {a} - {b}?", a - b
  if op == "mul":
    a, b = rng.randint(2, 19), rng.randint(11, 99)
    return f"What is {a} \\times {b}?", a * b
  a, b, c = rng.randint(2, 12), rng.randint(2, 12), rng.randint(1, 50)
  return f"What is {a} \\times {b} + {c}?", a * b + c


def make_split(rng: random.Random, n: int, exclude: set[str]) -> list[dict]:
  rows, seen, repeats = [], set(exclude), 0
  while len(rows) < n:
    op = OPERATIONS[len(rows) % len(OPERATIONS)]
    problem, answer = make_problem(rng, op)
    if problem in seen:
      repeats += 1
      if repeats > 100_000:
        raise SystemExit(f"only {len(rows)} distinct new {op!r} problems; ask for fewer")
      continue
    seen.add(problem)
    rows.append({"problem": problem, "answer": str(answer), "data_source": f"arith_{op}"})
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="runs/data/arith", help="output directory")
  parser.add_argument("--train", type=int, default=2000, help="training problems")
  parser.add_argument("--test", type=int, default=200, help="held-out problems")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  if args.train < 1 or args.test < 1:
    parser.error("--train and --test must be positive")
  rng = random.Random(args.seed)
  test = make_split(rng, args.test, set())
  train = make_split(rng, args.train, {r["problem"] for r in test})
  os.makedirs(args.out, exist_ok=True)
  for name, rows in (("train", train), ("test", test)):
    path = os.path.join(args.out, f"{name}.jsonl")
    with open(path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    print(json.dumps({"file": path, "rows": len(rows)}))


if __name__ == "__main__":
  main()
