"""Reward functions by name, the data_source -> reward routing, and the think gate.

A reward function takes (solution text, ground truth) and returns 1.0 / 0.0, or None
when no answer could be extracted (scored 0 and counted as `no_answer`). `grade` adds
the think gate (docs/algorithm.md §8): for prompts that end with "<think>", a response
without "</think>" scores 0 (`format`) and only the text after the first "</think>" is
checked (the reference's `response.split("</think>")[1]`).

Nothing from model output is evaluated as Python: Math-Verify parses LaTeX with its own
grammar and hands sympy only digit/operator strings; the other rewards use regexes, and
`reasoning_gym` calls that package's own verifiers (`gym.py`).
Math-Verify's own signal-based timeouts are switched off because `pool.py` enforces a
per-item deadline itself (both use SIGALRM, and Math-Verify would cancel ours).
"""

import fractions
import functools
import importlib
import logging
import re
from typing import Sequence

import math_verify

from exgrpo_jax import registry
from exgrpo_jax.rewards import gym

REWARDS = registry.Registry("reward")

# data_source -> reward; anything not listed is graded by Math-Verify.
SOURCE_REWARDS = {"arc_c": "multiple_choice", "gpqa": "multiple_choice",
                  "gpqa_diamond": "multiple_choice", "mmlu_pro": "multiple_choice",
                  "gsm8k": "gsm8k"}

# Per-item outcome codes (see `grade` and `pool.RewardPool`).
OK, FORMAT, NO_ANSWER, TIMEOUT, EXCEPTION, CRASH = (
    "ok", "format", "no_answer", "timeout", "exception", "crash")
STATUSES = (OK, FORMAT, NO_ANSWER, TIMEOUT, EXCEPTION, CRASH)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# With its timeouts off, Math-Verify warns once per process that we must time it out
# ourselves, which pool.py does.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def load_plugins(modules: str | Sequence[str]) -> tuple[str, ...]:
  """Imports reward plugin modules, which register their rewards in REWARDS on import.

  `modules` is a sequence of module names or one comma-separated string (the form of
  `config.reward.plugins`); returns the names imported. A module that cannot be imported
  raises ImportError naming it.
  """
  names = tuple(filter(None, (n.strip() for n in (
      modules.split(",") if isinstance(modules, str) else modules))))
  for name in names:
    try:
      importlib.import_module(name)
    except ImportError as e:
      raise ImportError(f"reward plugin module {name!r} cannot be imported: {e}") from e
  return names


def plugin_modules() -> tuple[str, ...]:
  """The modules, outside this package, that define the rewards registered so far.

  Reward workers import them first, so a reward registered in the main process (through
  `load_plugins` or by importing its module) is known in theirs. A script run as
  `__main__` is left out: `spawn` re-runs it in every worker, registering its rewards.
  """
  modules = (getattr(REWARDS.get(name), "__module__", None) for name in REWARDS.names())
  return tuple(dict.fromkeys(
      m for m in modules
      if m and m not in ("__main__", "__mp_main__") and not m.startswith("exgrpo_jax.")))


def reward_for_source(data_source: str, override: str = "") -> str:
  """The reward name for a data_source (`override`, when given, wins)."""
  name = override or SOURCE_REWARDS.get(data_source, "math_verify")
  REWARDS.get(name)  # a clear error for unknown names
  return name


def ends_with_think(prompt_text: str) -> bool:
  """Whether a rendered prompt opens a think block (then the think gate applies)."""
  return prompt_text.rstrip().endswith(THINK_OPEN)


def grade(response: str, ground_truth: str, reward_name: str,
          think_gate: bool) -> tuple[float, str]:
  """(reward, status) for one response; status is OK, FORMAT or NO_ANSWER."""
  if think_gate:
    if THINK_CLOSE not in response:
      return 0.0, FORMAT
    response = response.split(THINK_CLOSE)[1]
  reward = REWARDS.get(reward_name)(response, ground_truth)
  return (0.0, NO_ANSWER) if reward is None else (float(reward), OK)


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str):
  return math_verify.parse("$" + ground_truth + "$", parsing_timeout=None)


@REWARDS.register("math_verify")
def math_verify_reward(solution: str, ground_truth: str) -> float | None:
  """`verify(parse("$" + gt + "$"), parse(solution))`, as the reference's reward."""
  answer = math_verify.parse(solution, parsing_timeout=None)
  if not answer:
    return None
  return float(math_verify.verify(_parse_gold(ground_truth), answer, timeout_seconds=None))


@REWARDS.register("math_verify_boxed")
def math_verify_boxed_reward(solution: str, ground_truth: str) -> float | None:
  """Math-Verify on the last \\boxed{} only (the official eval extracts it this way)."""
  boxed = last_boxed(solution)
  return None if boxed is None else math_verify_reward(f"\\boxed{{{boxed}}}", ground_truth)


def last_boxed(text: str) -> str | None:
  """The contents of the last `\\boxed{...}` / `\\fbox{...}` (nested braces balanced)."""
  start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
  if start < 0:
    return None
  i = text.index("{", start) + 1
  depth = 1
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i:j]
  return None


_LATEX_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")
_SPECIAL_TOKENS = re.compile(r"<\|[^|]*\|>")


def extract_choice(text: str, options: str) -> str | None:
  """The chosen option (one of `options`, e.g. "ABCD" or "1234") or None.

  In order: the last \\boxed{} ("C", "(C)", "\\text{C}", "C) text"); the last
  "answer is C" / "ANSWER: C" / "Answer: (C)"; a last line that is only the option.
  """
  option = f"[{options}]"
  boxed = last_boxed(text)
  if boxed is not None:
    inner = _LATEX_WRAPPERS.sub(r"\1", boxed).strip().strip("$ ")
    m = re.match(rf"\(?({option})\)?(?![A-Za-z0-9])", inner)
    if m:
      return m.group(1)
  text = _SPECIAL_TOKENS.sub("", text)
  # One character class between "answer" and the option keeps matching linear.
  answers = re.findall(
      rf"(?i:answer)(?:\s+(?i:is))?[\s:：*$(\[]*(?:\\text\{{)?({option})(?![A-Za-z0-9])", text)
  if answers:
    return answers[-1]
  lines = [line.strip(" *$.\t") for line in text.splitlines() if line.strip(" *$.\t")]
  if lines:
    m = re.fullmatch(rf"\(?({option})\)?", lines[-1])
    if m:
      return m.group(1)
  return None


@REWARDS.register("multiple_choice")
def multiple_choice_reward(solution: str, ground_truth: str) -> float | None:
  """Letter (or digit) options, as in ARC-c and GPQA: compare the extracted choice."""
  truth = ground_truth.strip().strip("()").upper()
  options = "123456789" if truth.isdigit() else "ABCDEFGHIJ"
  choice = extract_choice(solution, options)
  return None if choice is None else float(choice.upper() == truth)


_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_FINAL_HASHES = rf"####[\s$]*({_NUMBER})"
_ANSWER_IS = rf"(?i:answer)(?:\s+is)?[\s:：$]*({_NUMBER})"


def _to_fraction(number: str) -> fractions.Fraction:
  return fractions.Fraction(number.replace(",", ""))


def extract_number(text: str) -> str | None:
  """The final numeric answer: the last \\boxed{}, "#### N", "answer is N", else the
  last number in the text. Thousands commas are allowed ("1,080"); units and currency
  signs around the number are ignored."""
  boxed = last_boxed(text)
  if boxed is not None:
    numbers = re.findall(_NUMBER, boxed.replace("\\!", "").replace("{,}", ","))
    if numbers:
      return numbers[0]
  for pattern in (_FINAL_HASHES, _ANSWER_IS):
    found = re.findall(pattern, text)
    if found:
      return found[-1]
  numbers = re.findall(_NUMBER, text)
  return numbers[-1] if numbers else None


@REWARDS.register("gsm8k")
def gsm8k_reward(solution: str, ground_truth: str) -> float | None:
  """GSM8K: the extracted final number equals the `#### N` answer (exact rational)."""
  number = extract_number(solution)
  if number is None:
    return None
  return float(_to_fraction(number) == _to_fraction(ground_truth.replace("$", "").strip()))


@REWARDS.register("reasoning_gym")
def reasoning_gym_reward(solution: str, ground_truth: str) -> float | None:
  """A reasoning_gym dataset's own verifier (ground truth: JSON naming the entry)."""
  return gym.score(solution, ground_truth)
