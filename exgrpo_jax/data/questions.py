"""Question records and the readers for the three file schemas.

* verl / ExGRPO parquet: `data_source`, `prompt` (a list of chat messages),
  `reward_model.ground_truth` (plus optional `extra_info`, `level`, `type`, ...).
* GSM8K parquet: `question`, `answer` (a solution ending `#### <number>`), optional
  `data_source` and `sample_id`.
* JSONL: one object per line with `problem` and `answer` (optional `data_source`, else
  the file name).

Every question gets `uid` = its row index in the file (the replay buffer keys on it), so
uids are stable across runs and restarts as long as the file is the same. A bad row is an
error naming the file, the row and the column, or, with `skip_bad_rows=True`, a counted
skip whose message is kept in `LoadResult.skipped`.
"""

import dataclasses
import json
import os
import re
from typing import Any

import numpy as np
import pandas as pd

from exgrpo_jax.rewards import graders

# Appended to bare questions (GSM8K, JSONL): the wording of math_train.parquet's prompts.
BOXED_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class DataError(ValueError):
  """A data file or one of its rows does not have the expected schema."""


@dataclasses.dataclass(frozen=True)
class Question:
  """One question, host side.

  Attributes:
    uid: row index within its file (stable; the replay buffer's key).
    messages: chat messages ({"role", "content"} dicts), as given by the file.
    ground_truth: the reference answer as text.
    data_source: benchmark / dataset name (picks the reward and groups eval metrics).
    reward_name: name of the reward function in `rewards.graders.REWARDS`.
    extra: anything else from the row (level, type, split, original solution, ...).
  """

  uid: int
  messages: tuple[dict[str, str], ...]
  ground_truth: str
  data_source: str
  reward_name: str
  extra: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def problem(self) -> str:
    """The text of the last user message (the problem itself)."""
    return next(m["content"] for m in reversed(self.messages) if m["role"] == "user")


@dataclasses.dataclass
class LoadResult:
  """Questions read from one file, and a message for every skipped row."""

  path: str
  questions: list[Question]
  skipped: list[str]


class _RowError(Exception):
  """A problem in one column of one row; the caller adds the file and row.

  `unusable` marks rows that are well formed but cannot be graded (an empty ground
  truth or question): those are always skipped and counted, never an error.
  """

  def __init__(self, column: str, message: str, unusable: bool = False):
    super().__init__(f"column {column!r}: {message}")
    self.unusable = unusable


def load_questions(path: str, *, skip_bad_rows: bool = False, limit: int = 0,
                   reward_name: str = "") -> LoadResult:
  """Reads a parquet (verl or GSM8K schema) or JSONL file of questions.

  Args:
    path: the file.
    skip_bad_rows: skip (and count) rows with a null or malformed field instead of
      raising. A missing column is always an error; an empty ground truth or question
      is always a counted skip (math_train.parquet has two such rows).
    limit: keep only the first `limit` rows (0 = all).
    reward_name: reward for every row; "" picks one per data_source.
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"data file does not exist: {path}")
  if path.endswith(".jsonl"):
    rows, parse = _jsonl_rows(path), _jsonl_question
  elif path.endswith(".parquet"):
    frame = pd.read_parquet(path)
    rows, parse = frame.to_dict("records"), _parquet_parser(path, set(frame.columns))
  else:
    raise DataError(f"{path}: unknown data format (expected .parquet or .jsonl)")
  if limit:
    rows = rows[:limit]
  stem = os.path.splitext(os.path.basename(path))[0]
  questions, skipped = [], []
  for uid, row in enumerate(rows):
    try:
      q = parse(uid, row, stem)
      questions.append(dataclasses.replace(
          q, reward_name=graders.reward_for_source(q.data_source, reward_name)))
    except _RowError as e:
      message = f"{path}: row {uid}, {e}"
      if not (skip_bad_rows or e.unusable):
        raise DataError(message) from None
      skipped.append(message)
  return LoadResult(path, questions, skipped)


def _parquet_parser(path: str, columns: set[str]):
  """The row parser for a parquet file's schema (verl or GSM8K), checking its columns."""
  if columns & {"prompt", "reward_model"}:
    schema, needed, parse = "verl", ("data_source", "prompt", "reward_model"), _verl_question
  elif columns & {"question", "answer"}:
    schema, needed, parse = "GSM8K", ("question", "answer"), _gsm8k_question
  else:
    raise DataError(f"{path}: unrecognised schema (columns: {', '.join(sorted(columns))}); "
                    "expected verl (data_source, prompt, reward_model) or GSM8K "
                    "(question, answer)")
  missing = [c for c in needed if c not in columns]
  if missing:
    raise DataError(f"{path}: missing column {missing[0]!r} for the {schema} schema "
                    f"(columns: {', '.join(sorted(columns))})")
  return parse


def _is_null(value) -> bool:
  return value is None or (isinstance(value, float) and np.isnan(value))


def _text(value, column: str) -> str:
  """A cell as a non-empty string; numbers are accepted and converted."""
  if _is_null(value):
    raise _RowError(column, "null value")
  if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
    value = str(value)
  if not isinstance(value, str):
    raise _RowError(column, f"expected text, got {type(value).__name__}")
  if not value.strip():
    raise _RowError(column, "empty text", unusable=True)
  return value


def _source(row: dict, stem: str) -> str:
  """The row's data_source, or the file name for schemas where it is optional."""
  value = row.get("data_source")
  return stem if _is_null(value) else _text(value, "data_source")


def _plain(value):
  """numpy scalars/arrays from parquet -> plain Python (JSON-friendly)."""
  if isinstance(value, np.ndarray):
    return [_plain(v) for v in value]
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  return value.item() if isinstance(value, np.generic) else value


def _messages(value) -> tuple[dict[str, str], ...]:
  if not isinstance(value, (list, tuple, np.ndarray)) or len(value) == 0:
    raise _RowError("prompt", f"expected a non-empty list of chat messages, got {value!r:.80}")
  messages = []
  for i, m in enumerate(value):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
        m.get("content"), str):
      raise _RowError("prompt", f"message {i} is not a {{role, content}} pair: {m!r:.80}")
    messages.append({"role": m["role"], "content": m["content"]})
  if not any(m["role"] == "user" for m in messages):
    raise _RowError("prompt", "no user message")
  return tuple(messages)


def _verl_question(uid: int, row: dict, stem: str) -> Question:
  del stem
  reward_model = row.get("reward_model")
  if not isinstance(reward_model, dict):
    raise _RowError("reward_model",
                    f"expected a struct with ground_truth, got {reward_model!r:.80}")
  ground_truth = _text(reward_model.get("ground_truth"), "reward_model.ground_truth")
  extra = {k: _plain(v) for k, v in row.items()
           if k not in ("prompt", "reward_model", "data_source") and not _is_null(v)}
  return Question(uid, _messages(row.get("prompt")), ground_truth,
                  _text(row.get("data_source"), "data_source"), "", extra)


def _gsm8k_question(uid: int, row: dict, stem: str) -> Question:
  question = _text(row.get("question"), "question")
  solution = _text(row.get("answer"), "answer")
  match = _GSM8K_FINAL.search(solution)
  final = match.group(1).replace(",", "").replace("$", "").strip() if match else ""
  if not _NUMBER.fullmatch(final):
    raise _RowError("answer", f"no '#### <number>' final answer in {solution[-60:]!r}")
  data_source = _source(row, stem)
  extra = {"solution": solution}
  if not _is_null(row.get("sample_id")):
    extra["sample_id"] = _plain(row["sample_id"])
  messages = ({"role": "user", "content": f"{question} {BOXED_INSTRUCTION}"},)
  return Question(uid, messages, final, data_source, "", extra)


def _jsonl_rows(path: str) -> list[dict]:
  rows = []
  with open(path, encoding="utf-8") as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        message = f"{path}: line {line_no} (row {len(rows)}) is not valid JSON: {e}"
        raise DataError(message) from None
      if not isinstance(row, dict):
        raise DataError(f"{path}: line {line_no} (row {len(rows)}) is not a JSON object")
      rows.append(row)
  if rows:
    missing = [c for c in ("problem", "answer") if c not in set().union(*rows)]
    if missing:
      raise DataError(f"{path}: missing column {missing[0]!r} for the JSONL schema "
                      "(every row lacks it)")
  return rows


def _jsonl_question(uid: int, row: dict, stem: str) -> Question:
  problem = _text(row.get("problem"), "problem")
  data_source = _source(row, stem)
  messages = ({"role": "user", "content": f"{problem} {BOXED_INSTRUCTION}"},)
  extra = {k: v for k, v in row.items() if k not in ("problem", "answer", "data_source")}
  return Question(uid, messages, _text(row.get("answer"), "answer"), data_source, "", extra)
