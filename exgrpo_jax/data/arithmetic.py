r"""Integer arithmetic generated from a seed: a training task that needs no files.

  questions = arithmetic.make_questions(ArithmeticSettings(max_operand=20), "train")

Every question is one expression with an exact integer answer ("What is 47 + 38?"),
rendered as a chat user message followed by `instruction`. Difficulty comes from
`operations` (add, sub, mul, mixed = a x b + c) and `max_operand`, the bound of the
large operands. The `eval` split is drawn first and the `train` split never repeats one of
its problem texts, so the held-out accuracy measures questions the policy never trained
on. Both splits are pure functions of the settings (uid = index within the split).

The answers are integers, so the numeric `gsm8k` reward grades them: the last \boxed{}
number, else "answer is N", else the last number in the response, compared exactly.
"""

import dataclasses
import random

from exgrpo_jax.data import questions as questions_lib

OPERATIONS = ("add", "sub", "mul", "mixed")
SPLITS = ("train", "eval")
REWARD = "gsm8k"


@dataclasses.dataclass(frozen=True)
class ArithmeticSettings:
  """The task's size and difficulty (config section `data.arithmetic`).

  The defaults are the CPU default run's task (configs/smollm2_135m.py): SmolLM2-135M-
  Instruct solves about 31% of them at temperature 0.7 and 14% at temperature 1
  (scripts/bench/calibrate_arithmetic.py, 32 questions x 2 samples, 48 new tokens).

  Attributes:
    seed: the generator's seed; the same settings always give the same questions.
    train_size: questions in the training split.
    eval_size: questions in the held-out split.
    operations: comma-separated kinds, taken round-robin (`OPERATIONS`).
    max_operand: largest operand (add/sub: both in [0, max_operand] with a - b >= 0;
      mul: a in [2, 9], b in [2, max_operand]; mixed: a, b in [2, 9], c in
      [1, max_operand]).
    instruction: appended to every problem.
  """

  seed: int = 0
  train_size: int = 200
  eval_size: int = 60
  operations: str = "add,sub"
  max_operand: int = 15
  instruction: str = "Answer with only the number."

  def __post_init__(self):
    ops = self.operation_list
    bad = [op for op in ops if op not in OPERATIONS]
    if not ops or bad:
      raise ValueError(f"arithmetic operations={self.operations!r}: use a comma-separated "
                       f"subset of {', '.join(OPERATIONS)}")
    if not 2 <= self.max_operand <= 10**6:
      raise ValueError(f"arithmetic max_operand={self.max_operand}: must be in [2, 10**6]")
    if self.train_size < 1 or self.eval_size < 1:
      raise ValueError(f"arithmetic train_size={self.train_size}, eval_size="
                       f"{self.eval_size}: both must be positive")

  @classmethod
  def parse(cls, text: str) -> "ArithmeticSettings":
    """Settings from "field=value;field=value" (the defaults for the rest)."""
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    values = {}
    for part in filter(None, text.split(";")):
      name, _, value = part.partition("=")
      if name not in types:
        raise ValueError(f"arithmetic setting {part!r}: unknown field {name!r}; known: "
                         f"{', '.join(types)}")
      try:
        values[name] = int(value) if types[name] in (int, "int") else value
      except ValueError:
        raise ValueError(f"arithmetic setting {part!r}: {name} must be an integer") from None
    return cls(**values)

  @property
  def operation_list(self) -> list[str]:
    return [op.strip() for op in self.operations.split(",") if op.strip()]


def make_problem(rng: random.Random, op: str, max_operand: int) -> tuple[str, int]:
  """One problem text and its integer answer."""
  if op == "add":
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    return f"What is {a} + {b}?", a + b
  if op == "sub":  # a >= b: negative results are much harder for small models
    a, b = sorted((rng.randint(0, max_operand), rng.randint(0, max_operand)), reverse=True)
    return f"What is {a} - {b}?", a - b
  if op == "mul":
    a, b = rng.randint(2, 9), rng.randint(2, max_operand)
    return f"What is {a} \\times {b}?", a * b
  a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, max_operand)
  return f"What is {a} \\times {b} + {c}?", a * b + c


def _split_rows(rng: random.Random, n: int, ops: list[str], max_operand: int,
                exclude: set[str]) -> list[tuple[str, int, str]]:
  rows, seen, repeats = [], set(exclude), 0
  while len(rows) < n:
    op = ops[len(rows) % len(ops)]
    problem, answer = make_problem(rng, op, max_operand)
    if problem in seen:
      repeats += 1
      if repeats > 100_000:
        raise ValueError(f"arithmetic: only {len(rows)} distinct {op!r} problems with "
                         f"max_operand={max_operand}; ask for fewer questions or a larger "
                         "max_operand")
      continue
    seen.add(problem)
    rows.append((problem, answer, op))
  return rows


def make_questions(settings: ArithmeticSettings, split: str,
                   limit: int = 0) -> list[questions_lib.Question]:
  """The questions of one split ("train" or "eval"); `limit` keeps the first N."""
  if split not in SPLITS:
    raise ValueError(f"arithmetic split {split!r}: use one of {', '.join(SPLITS)}")
  rng = random.Random(settings.seed)
  ops = settings.operation_list
  held_out = _split_rows(rng, settings.eval_size, ops, settings.max_operand, set())
  rows = held_out
  if split == "train":
    rows = _split_rows(rng, settings.train_size, ops, settings.max_operand,
                       {problem for problem, _, _ in held_out})
  if limit:
    rows = rows[:limit]
  return [questions_lib.Question(
      uid, ({"role": "user", "content": f"{problem} {settings.instruction}"},), str(answer),
      f"arith_{op}", REWARD, {"split": split}) for uid, (problem, answer, op) in enumerate(rows)]
