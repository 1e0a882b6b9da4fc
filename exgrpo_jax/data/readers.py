"""Where question rows come from: files, `datasets` directories and the hub, under a data dir.

A data spec (`data.train_path`, `eval.path`) is one source, or several separated by commas
(their rows are concatenated in order):

  FILE.parquet, FILE.jsonl, FILE.json   a table of rows (JSON: an array of objects)
  DIR[@SPLIT]                           a `datasets` save_to_disk directory (split of a
                                        DatasetDict; default train), or a directory of
                                        such files (a hub snapshot's data/: the files
                                        named SPLIT*, default train* where there are
                                        any, else all), read in name order
  hf:OWNER/NAME[/CONFIG][@SPLIT]        a Hugging Face hub dataset (online; default train)

A relative path that exists in the working directory is read from there; any other
relative path resolves against the data directory: `data.dir`, else `$EXGRPO_DATA_DIR`,
else `~/.cache/exgrpo_jax/data`, where `python -m exgrpo_jax.prepare_data` writes the
paper's files (so the configs' bare names find them from any directory). Which
columns a table needs is `questions.py`'s business; here a row is a dict, or a `BadRow`
when the bytes of that row could not be read (not UTF-8, not JSON).
"""

import dataclasses
import json
import os

import pandas as pd

from exgrpo_jax import cli

ENV_VAR = "EXGRPO_DATA_DIR"
HUB_PREFIX = "hf:"
PREPARE = "python -m exgrpo_jax.prepare_data --out"
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
# What `datasets`' save_to_disk writes (a Dataset; a DatasetDict).
DATASETS_MARKERS = ("state.json", "dataset_dict.json")


class DataError(ValueError):
  """A data source, or one of its rows, cannot be read as questions."""


@dataclasses.dataclass(frozen=True)
class BadRow:
  """A row whose bytes could not be parsed; `message` says where and why."""

  message: str


@dataclasses.dataclass
class Table:
  """The rows of one source. `name` is what errors call it, `stem` the default data_source."""

  name: str
  stem: str
  rows: list
  columns: set


def default_dir() -> str:
  """`$EXGRPO_DATA_DIR`, else the cache's `data/` (prepare_data's default output)."""
  from exgrpo_jax.models import loading  # pylint: disable=g-import-not-at-top
  return os.environ.get(ENV_VAR) or os.path.join(loading.cache_root(), "data")


def split_spec(spec: str) -> list[str]:
  return [part.strip() for part in spec.split(",") if part.strip()]


def resolve(part: str, data_dir: str = "") -> str:
  """One source with a relative path made absolute: the working directory's file or
  directory where it exists there, else the data directory's."""
  part = os.path.expanduser(part)
  if part.startswith(HUB_PREFIX) or os.path.isabs(part):
    return part
  if os.path.exists(_local(part)[0]):
    return os.path.abspath(part)
  return os.path.join(os.path.expanduser(data_dir or default_dir()), part)


def _local(part: str) -> tuple[str, str]:
  """(path, split) of a local source; only directories take an @split."""
  path, _, split = part.rpartition("@")
  if path and os.path.isdir(path):
    return path, split
  return part, ""


def missing(spec: str, data_dir: str = "") -> str | None:
  """One line naming the first local source of `spec` that does not exist, else None."""
  for part in split_spec(spec):
    path = resolve(part, data_dir)
    if not path.startswith(HUB_PREFIX) and not os.path.exists(_local(path)[0]):
      if os.path.isabs(os.path.expanduser(part)):
        return f"{path}: no such file"
      directory = os.path.expanduser(data_dir or default_dir())
      line = (f"{part}: no such file in the working directory ({os.getcwd()}) or the data "
              f"directory (data.dir={directory!r})")
      if os.sep in part:
        return line
      # A bare name may be one of the paper's files, which prepare_data writes there.
      return f"{line}; the paper's data files download there with: {PREPARE} {directory}"
  return None


def read_tables(spec: str, data_dir: str = "") -> list[Table]:
  """Every source of `spec`, read."""
  parts = split_spec(spec)
  if not parts:
    raise DataError("no data source given (an empty path)")
  problem = missing(spec, data_dir)
  if problem:
    raise DataError(problem)
  return [_read(resolve(part, data_dir)) for part in parts]


def _read(source: str) -> Table:
  if source.startswith(HUB_PREFIX):
    return _read_hub(source)
  path, split = _local(source)
  stem = os.path.splitext(os.path.basename(path.rstrip("/")))[0]
  if os.path.isdir(path):
    if any(os.path.exists(os.path.join(path, marker)) for marker in DATASETS_MARKERS):
      return _read_disk(path, split, stem)
    return _read_files(path, split, stem)
  return _read_file(path, stem)


def _read_file(path: str, stem: str) -> Table:
  if path.endswith(".parquet"):
    try:
      frame = pd.read_parquet(path)
    except Exception as e:  # pyarrow's errors have no common base worth naming
      raise DataError(f"{path}: not a readable parquet file ({cli.one_line(e)})") from None
    return _frame_table(path, stem, frame)
  if path.endswith(".jsonl"):
    return _read_jsonl(path, stem)
  if path.endswith(".json"):
    return _read_json(path, stem)
  raise DataError(f"{path}: unknown data format (expected .parquet, .jsonl, .json, a "
                  "`datasets` save_to_disk directory or hf:OWNER/NAME)")


def _read_files(path: str, split: str, stem: str) -> Table:
  """A directory's data files as one table (see the module docstring for which)."""
  names = sorted(os.listdir(path))
  files = [n for n in names if n.endswith(DATA_SUFFIXES)
           and os.path.isfile(os.path.join(path, n))]
  if not files:
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") or "nothing"
    raise DataError(f"{path}: a directory with no data files ({', '.join(DATA_SUFFIXES)}), "
                    f"nor a `datasets` save_to_disk directory; it holds {shown}")
  chosen = [n for n in files if n.startswith(split or "train")]
  if split and not chosen:
    raise DataError(f"{path}@{split}: no data file named {split}* (it holds "
                    f"{', '.join(files)})")
  tables = [_read_file(os.path.join(path, n), stem) for n in chosen or files]
  columns = [t.columns for t in tables]
  if any(c != columns[0] for c in columns):
    different = next(t for t in tables if t.columns != columns[0])
    raise DataError(f"{different.name}: columns {sorted(different.columns)} differ from "
                    f"{tables[0].name}'s {sorted(columns[0])}")
  return Table(path, stem, [row for t in tables for row in t.rows], columns[0])


def _frame_table(name: str, stem: str, frame: pd.DataFrame) -> Table:
  return Table(name, stem, frame.to_dict("records"), set(frame.columns))


def _not_utf8(raw: bytes, e: UnicodeDecodeError) -> str:
  return f"byte {raw[e.start]:#04x} at offset {e.start} is not UTF-8"


def _read_jsonl(path: str, stem: str) -> Table:
  rows, columns = [], set()
  with open(path, "rb") as f:
    for line_no, raw in enumerate(f, 1):
      if not raw.strip():
        continue
      try:
        row = json.loads(raw.rstrip(b"\r\n").decode("utf-8"))
      except UnicodeDecodeError as e:
        row = BadRow(f"line {line_no}: {_not_utf8(raw, e)}")
      except json.JSONDecodeError as e:
        row = BadRow(f"line {line_no} is not valid JSON: {e.msg} (column {e.colno})")
      if isinstance(row, dict):
        columns.update(row)
      elif not isinstance(row, BadRow):
        row = BadRow(f"line {line_no} is not a JSON object")
      rows.append(row)
  return Table(path, stem, rows, columns)


def _read_json(path: str, stem: str) -> Table:
  with open(path, "rb") as f:
    raw = f.read()
  try:
    value = json.loads(raw.decode("utf-8"))
  except UnicodeDecodeError as e:
    line = raw.count(b"\n", 0, e.start) + 1
    raise DataError(f"{path}: line {line}: {_not_utf8(raw, e)}") from None
  except json.JSONDecodeError as e:
    raise DataError(f"{path}: line {e.lineno} is not valid JSON: {e.msg} "
                    f"(column {e.colno})") from None
  if not isinstance(value, list):
    raise DataError(f"{path}: expected a JSON array of row objects, got "
                    f"{type(value).__name__}")
  rows = [row if isinstance(row, dict) else BadRow(f"element {i} is not a JSON object")
          for i, row in enumerate(value)]
  return Table(path, stem, rows, set().union(*(r for r in rows if isinstance(r, dict))))


def _datasets(source: str):
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise DataError(f"{source}: reading it needs the `datasets` package: "
                    "pip install 'exgrpo_jax[data]'") from None
  return datasets


def _read_disk(path: str, split: str, stem: str) -> Table:
  datasets = _datasets(path)
  try:
    loaded = datasets.load_from_disk(path)
  except Exception as e:  # datasets raises FileNotFoundError/ValueError/... for non-datasets dirs
    raise DataError(f"{path}: not a `datasets` save_to_disk directory "
                    f"({cli.one_line(e)})") from None
  if isinstance(loaded, datasets.DatasetDict):
    split = split or "train"
    if split not in loaded:
      raise DataError(f"{path}: no split {split!r} (splits: {', '.join(loaded)}); "
                      f"name one as {path}@SPLIT")
    loaded = loaded[split]
  return _frame_table(path, stem, loaded.to_pandas())


def parse_hub_name(source: str) -> tuple[str, str | None, str]:
  """`hf:OWNER/NAME[/CONFIG][@SPLIT]` -> (repo id, config or None, split)."""
  name, _, split = source[len(HUB_PREFIX):].partition("@")
  parts = name.split("/")
  if len(parts) not in (2, 3) or not all(parts):
    raise DataError(f"{source}: expected hf:OWNER/NAME[/CONFIG][@SPLIT]")
  return "/".join(parts[:2]), (parts[2] if len(parts) == 3 else None), split or "train"


def load_hub(source: str):
  """A split of a hub dataset as a `datasets.Dataset` (needs the network)."""
  repo, config, split = parse_hub_name(source)
  datasets = _datasets(source)
  try:
    return datasets.load_dataset(repo, config, split=split)
  except Exception as e:  # offline, unknown name or split: whatever the hub client raises
    raise DataError(f"{source}: cannot load it from the Hugging Face hub "
                    f"({type(e).__name__}: {cli.one_line(e)})") from None


def _read_hub(source: str) -> Table:
  repo, _, _ = parse_hub_name(source)
  return _frame_table(source, repo.split("/")[1], load_hub(source).to_pandas())
