"""Question records, and the column schemas a table of questions can have.

The rows come from `readers.py` (parquet, JSON, JSONL, a `datasets` directory, the hub, or a
comma-separated list of those). Whatever the container, the columns pick the schema:

* verl / ExGRPO: `data_source`, `prompt` (a list of chat messages),
  `reward_model.ground_truth` (plus optional `extra_info`, `level`, `type`, ...).
* TRL: `prompt` (text or chat messages) plus `solution` or `answer`.
* GSM8K: `question`, `answer` (a solution ending `#### <number>`), optional `data_source`
  and `sample_id`. A file is GSM8K when any of its answers holds `####`; then every answer
  must end in `#### <number>`, which becomes the ground truth.
* problem: `problem` (or `question`, in a file none of whose answers holds `####`) plus
  `answer` or `solution` (MATH's columns): generic math, the answer as it is.

A `solution` without an `answer` gives the ground truth as its last `\\boxed{}` (the whole
text when it has none). Rows without `data_source` take the file's name. Bare questions
(GSM8K, question, problem) get the `\\boxed{}` instruction of math_train.parquet's
prompts; TRL prompts are used as given.

Every question gets `uid` = its row index (across the files of a list, in order; the
replay buffer keys on it), so uids are stable across runs and restarts as long as the data
is the same. A bad row is an error naming the file, the row and the column, or, with
`skip_bad_rows=True`, a counted skip whose message is kept in `LoadResult.skipped`.
"""

import dataclasses
import re
from typing import Any

import numpy as np

from exgrpo_jax.data import readers
from exgrpo_jax.data.readers import DataError
from exgrpo_jax.rewards import graders

# Appended to bare questions (GSM8K, question, problem): math_train.parquet's wording.
BOXED_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


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
  """Questions read from one data spec, and a message for every skipped row."""

  path: str
  questions: list[Question]
  skipped: list[str]


class _RowError(Exception):
  """A problem in one column of one row; the caller adds the file and row.

  `unusable` marks rows that are well formed but cannot be graded (an empty ground
  truth): those are always skipped and counted, never an error.
  """

  def __init__(self, column: str, message: str, unusable: bool = False):
    super().__init__(f"column {column!r}: {message}" if column else message)
    self.unusable = unusable


def load_questions(path: str, *, skip_bad_rows: bool = False, limit: int = 0,
                   reward_name: str = "", data_dir: str = "") -> LoadResult:
  """Reads the questions of a data spec (see `readers.py`: files, lists, directories, hub).

  Args:
    path: the data spec; relative paths resolve against `data_dir`.
    skip_bad_rows: skip (and count) rows with a null, malformed or unreadable field
      instead of raising. A missing column is always an error; an empty ground truth is
      always a counted skip (math_train.parquet has two such rows).
    limit: keep only the first `limit` rows (0 = all).
    reward_name: reward for every row; "" picks one per data_source.
    data_dir: the data directory ("" = `readers.default_dir()`).
  """
  questions, skipped, uid = [], [], 0
  for table in readers.read_tables(path, data_dir):
    parse = _parser(table)
    for row_index, row in enumerate(table.rows):
      if limit and uid >= limit:
        break
      try:
        if isinstance(row, readers.BadRow):
          raise _RowError("", row.message)
        q = parse(uid, row, table.stem)
        questions.append(dataclasses.replace(
            q, reward_name=graders.reward_for_source(q.data_source, reward_name)))
      except _RowError as e:
        message = f"{table.name}: row {row_index}, {e}"
        if not (skip_bad_rows or e.unusable):
          raise DataError(message) from None
        skipped.append(message)
      uid += 1
  return LoadResult(path, questions, skipped)


# Schema name -> (required columns, alternatives of which one is required).
_SCHEMAS = {"verl": (("data_source", "prompt", "reward_model"), ()),
            "TRL": (("prompt",), ("solution", "answer")),
            "GSM8K": (("question", "answer"), ()),
            "question": (("question",), ("answer", "solution")),
            "problem": (("problem",), ("answer", "solution"))}
_GSM8K_MARK = "####"


def _parser(table: readers.Table):
  """The row parser for a table's schema, checking its columns."""
  columns = table.columns
  if "reward_model" in columns or ("prompt" in columns and
                                   not columns & {"solution", "answer"}):
    schema, parse = "verl", _verl_question
  elif "prompt" in columns:
    schema, parse = "TRL", _trl_question
  elif "question" in columns and _has_gsm8k_answers(table.rows):
    schema, parse = "GSM8K", _gsm8k_question
  elif "question" in columns:
    schema, parse = "question", _bare_question("question")
  elif "problem" in columns:
    schema, parse = "problem", _bare_question("problem")
  else:
    raise DataError(f"{table.name}: unrecognised schema (columns: "
                    f"{', '.join(sorted(columns)) or 'none'}); expected verl (data_source, "
                    "prompt, reward_model), TRL (prompt, solution or answer), GSM8K "
                    "(question, answer ending '#### N'), question (question, answer or "
                    "solution) or problem (problem, answer or solution)")
  needed, one_of = _SCHEMAS[schema]
  missing = [c for c in needed if c not in columns]
  if one_of and not columns & set(one_of):
    missing.append(" or ".join(repr(c) for c in one_of)[1:-1])
  if missing:
    raise DataError(f"{table.name}: missing column '{missing[0]}' for the {schema} schema "
                    f"(columns: {', '.join(sorted(columns))})")
  return parse


def _has_gsm8k_answers(rows: list) -> bool:
  """Whether any row's `answer` holds GSM8K's `####` (then the file is read as GSM8K)."""
  return any(isinstance(row, dict) and isinstance(row.get("answer"), str)
             and _GSM8K_MARK in row["answer"] for row in rows)


def _is_null(value) -> bool:
  return value is None or (isinstance(value, float) and np.isnan(value))


def _text(value, column: str, empty_unusable: bool = False) -> str:
  """A cell as a non-empty string; numbers are accepted and converted.

  An empty ground truth (`empty_unusable`) makes the row a counted skip; any other empty
  text is an error.
  """
  if _is_null(value):
    raise _RowError(column, "null value")
  if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
    value = str(value)
  if not isinstance(value, str):
    raise _RowError(column, f"expected text, got {type(value).__name__}")
  if not value.strip():
    raise _RowError(column, "empty text", unusable=empty_unusable)
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
  users = [m["content"] for m in messages if m["role"] == "user"]
  if not users:
    raise _RowError("prompt", "no user message")
  if not users[-1].strip():
    raise _RowError("prompt", "empty user message")
  return tuple(messages)


def _verl_question(uid: int, row: dict, stem: str) -> Question:
  del stem
  reward_model = row.get("reward_model")
  if not isinstance(reward_model, dict):
    raise _RowError("reward_model",
                    f"expected a struct with ground_truth, got {reward_model!r:.80}")
  ground_truth = _text(reward_model.get("ground_truth"), "reward_model.ground_truth",
                       empty_unusable=True)
  extra = {k: _plain(v) for k, v in row.items()
           if k not in ("prompt", "reward_model", "data_source") and not _is_null(v)}
  return Question(uid, _messages(row.get("prompt")), ground_truth,
                  _text(row.get("data_source"), "data_source"), "", extra)


def _gsm8k_question(uid: int, row: dict, stem: str) -> Question:
  question = _text(row.get("question"), "question")
  solution = _text(row.get("answer"), "answer", empty_unusable=True)
  match = _GSM8K_FINAL.search(solution)
  final = match.group(1).replace(",", "").replace("$", "").strip() if match else ""
  if not _NUMBER.fullmatch(final):
    raise _RowError("answer", f"no '#### <number>' final answer in {solution[-60:]!r} "
                    "(read as GSM8K: answers in this file hold '####')")
  data_source = _source(row, stem)
  extra = {"solution": solution}
  if not _is_null(row.get("sample_id")):
    extra["sample_id"] = _plain(row["sample_id"])
  messages = ({"role": "user", "content": f"{question} {BOXED_INSTRUCTION}"},)
  return Question(uid, messages, final, data_source, "", extra)


def _answer(row: dict) -> str:
  """The ground truth of a TRL/question/problem row: `answer`, else the solution's
  last \\boxed{}."""
  answer, solution = row.get("answer"), row.get("solution")
  if not _is_null(answer) or _is_null(solution):
    return _text(answer, "answer", empty_unusable=True)
  solution = _text(solution, "solution", empty_unusable=True)
  boxed = graders.last_boxed(solution)
  return solution.strip() if boxed is None else _text(boxed, "solution", empty_unusable=True)


def _rest(row: dict, *used: str) -> dict:
  return {k: _plain(v) for k, v in row.items() if k not in used and not _is_null(v)}


def _trl_question(uid: int, row: dict, stem: str) -> Question:
  prompt = row.get("prompt")
  if isinstance(prompt, str):
    messages = ({"role": "user", "content": _text(prompt, "prompt")},)
  else:
    messages = _messages(prompt)
  return Question(uid, messages, _answer(row), _source(row, stem), "",
                  _rest(row, "prompt", "answer", "data_source"))


def _bare_question(column: str):
  """The parser of a bare question in `column` ("problem" or "question") with its answer."""

  def parse(uid: int, row: dict, stem: str) -> Question:
    problem = _text(row.get(column), column)
    messages = ({"role": "user", "content": f"{problem} {BOXED_INSTRUCTION}"},)
    return Question(uid, messages, _answer(row), _source(row, stem), "",
                    _rest(row, column, "answer", "data_source"))

  return parse
