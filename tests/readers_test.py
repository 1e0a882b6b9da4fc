"""The data users bring: formats, schemas, lists, where relative paths are looked up, and
one-line errors for bad data."""

import importlib
import json
import subprocess
import sys

import pandas as pd
import pytest

from exgrpo_jax import data
from exgrpo_jax.data import readers
from exgrpo_jax.data import sources
from exgrpo_jax.rewards import graders
from exgrpo_jax.training import config_check
from tests import conftest


def _verl_frame(n=4):
  return pd.DataFrame({
      "data_source": ["toy"] * n,
      "prompt": [[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": f"What is {i} + 1?"}] for i in range(n)],
      "reward_model": [{"ground_truth": str(i + 1), "style": "rule"} for i in range(n)],
      "extra_info": [{"index": i, "split": "train"} for i in range(n)],
  })


def _summary(loaded):
  return [(q.uid, q.messages, q.ground_truth, q.data_source, q.reward_name, q.extra)
          for q in loaded.questions]


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_verl_schema_reads_the_same_from_parquet_json_and_jsonl(tmp_path):
  frame = _verl_frame()
  frame.to_parquet(tmp_path / "toy.parquet")
  records = frame.to_dict("records")
  (tmp_path / "toy.json").write_text(json.dumps(records))
  _write_jsonl(tmp_path / "toy.jsonl", records)
  expected = _summary(data.load_questions(str(tmp_path / "toy.parquet")))
  assert expected[1][1][1] == {"role": "user", "content": "What is 1 + 1?"}
  for name in ("toy.json", "toy.jsonl"):
    assert _summary(data.load_questions(name, data_dir=str(tmp_path))) == expected


def test_trl_and_problem_columns(tmp_path):
  _write_jsonl(tmp_path / "trl.jsonl", [
      {"prompt": "Compute 6*7.", "solution": "6*7 = \\boxed{42}."},
      {"prompt": [{"role": "user", "content": "Half of 3?"}], "answer": "3/2", "id": 7},
      {"prompt": "Name the prime after 2.", "solution": "3"}])
  trl = data.load_questions(str(tmp_path / "trl.jsonl")).questions
  assert [(q.problem, q.ground_truth) for q in trl] == [
      ("Compute 6*7.", "42"), ("Half of 3?", "3/2"), ("Name the prime after 2.", "3")]
  assert trl[0].extra == {"solution": "6*7 = \\boxed{42}."} and trl[1].extra == {"id": 7}
  assert {q.data_source for q in trl} == {"trl"}
  math = pd.DataFrame({"problem": ["Solve $x+1=3$."], "level": ["Level 1"],
                       "type": ["Algebra"], "solution": ["So $x=\\boxed{2}$."]})
  math.to_parquet(tmp_path / "math.parquet")
  [q] = data.load_questions(str(tmp_path / "math.parquet")).questions
  assert q.problem == f"Solve $x+1=3$. {data.BOXED_INSTRUCTION}" and q.ground_truth == "2"
  assert q.extra["level"] == "Level 1" and q.reward_name == "math_verify"


def test_a_list_of_files_numbers_rows_across_files_and_names_each_file(tmp_path):
  _verl_frame(3).to_parquet(tmp_path / "a.parquet")
  _write_jsonl(tmp_path / "b.jsonl", [{"problem": "1+1?", "answer": "2"},
                                      {"problem": "2+2?", "answer": None}])
  with pytest.raises(data.DataError) as e:
    data.load_questions("a.parquet, b.jsonl", data_dir=str(tmp_path))
  assert str(e.value) == f"{tmp_path}/b.jsonl: row 1, column 'answer': null value"
  loaded = data.load_questions("a.parquet,b.jsonl", data_dir=str(tmp_path),
                               skip_bad_rows=True)
  assert [(q.uid, q.data_source) for q in loaded.questions] == [
      (0, "toy"), (1, "toy"), (2, "toy"), (3, "b")]
  assert loaded.skipped == [str(e.value)]
  limited = data.load_questions("a.parquet,b.jsonl", data_dir=str(tmp_path), limit=4)
  assert [q.uid for q in limited.questions] == [0, 1, 2, 3]


def test_relative_paths_resolve_against_data_dir_then_the_environment(tmp_path, monkeypatch):
  _verl_frame(2).to_parquet(tmp_path / "toy.parquet")
  monkeypatch.setenv(readers.ENV_VAR, str(tmp_path))
  assert readers.default_dir() == str(tmp_path)
  assert len(data.load_questions("toy.parquet").questions) == 2
  assert readers.missing("toy.parquet") is None
  monkeypatch.delenv(readers.ENV_VAR)
  monkeypatch.setenv("EXGRPO_JAX_CACHE", str(tmp_path / "cache"))
  assert readers.default_dir() == str(tmp_path / "cache" / "data")
  other = tmp_path / "elsewhere"
  with pytest.raises(data.DataError) as e:
    data.load_questions("toy.parquet", data_dir=str(other))
  assert str(e.value) == (
      f"toy.parquet: no such file in the working directory ({conftest.REPO_ROOT}) or the "
      f"data directory (data.dir='{other}'); the paper's data files download there with: "
      f"python -m exgrpo_jax.prepare_data --out {other}")
  # Only a bare name can be one of the paper's files; an absolute path is only itself.
  assert readers.missing("mine/toy.parquet", str(other)) == (
      f"mine/toy.parquet: no such file in the working directory ({conftest.REPO_ROOT}) or "
      f"the data directory (data.dir='{other}')")
  assert readers.missing(f"{other}/toy.parquet") == f"{other}/toy.parquet: no such file"


def test_a_relative_path_that_exists_in_the_working_directory_is_read_from_there(
    tmp_path, monkeypatch):
  prepared, here = tmp_path / "prepared", tmp_path / "here"
  for directory, answer in ((prepared, "2"), (here, "4")):
    (directory / "sub").mkdir(parents=True)
    _write_jsonl(directory / "sub" / "toy.jsonl", [{"problem": "x?", "answer": answer}])
  _write_jsonl(prepared / "only_prepared.jsonl", [{"problem": "y?", "answer": "6"}])
  monkeypatch.chdir(here)
  c = importlib.import_module("configs.tiny").get_config()
  c.data.source, c.data.dir = "file", str(prepared)
  c.data.train_path = "sub/toy.jsonl, only_prepared.jsonl"
  config_check.check(c)
  loaded = sources.load(c, "train")
  assert [q.ground_truth for q in loaded.questions] == ["4", "6"]
  assert readers.resolve("sub/toy.jsonl", str(prepared)) == str(here / "sub" / "toy.jsonl")
  assert readers.resolve("only_prepared.jsonl", str(prepared)) == str(
      prepared / "only_prepared.jsonl")


def test_question_and_answer_without_hashes_is_generic_math(tmp_path):
  path = tmp_path / "own.jsonl"
  _write_jsonl(path, [{"question": "What is 2+3?", "answer": "5"},
                      {"question": "Half of 9?", "answer": "\\frac{9}{2}", "level": 1},
                      {"question": "Seven?", "answer": 7}])
  loaded = data.load_questions(str(path)).questions
  assert [(q.problem, q.ground_truth, q.data_source, q.reward_name, q.extra)
          for q in loaded] == [
              (f"What is 2+3? {data.BOXED_INSTRUCTION}", "5", "own", "math_verify", {}),
              (f"Half of 9? {data.BOXED_INSTRUCTION}", "\\frac{9}{2}", "own", "math_verify",
               {"level": 1}),
              (f"Seven? {data.BOXED_INSTRUCTION}", "7", "own", "math_verify", {})]
  assert graders.grade("So \\boxed{4.5}.", loaded[1].ground_truth, loaded[1].reward_name,
                       False) == (1.0, graders.OK)
  _write_jsonl(path, [{"question": "6*7?", "solution": "6*7 = \\boxed{42}"}])
  assert [q.ground_truth for q in data.load_questions(str(path)).questions] == ["42"]
  # Bad rows of such a file are one line, as in any other.
  _write_jsonl(path, [{"question": "1+1?", "answer": "2"}, {"question": "x", "answer": None}])
  with pytest.raises(data.DataError) as e:
    data.load_questions(str(path))
  assert str(e.value) == f"{path}: row 1, column 'answer': null value"
  # A file whose answers hold '####' is GSM8K: each answer must end in '#### N'.
  _write_jsonl(path, [{"question": "1+1?", "answer": "1+1=2\n#### 2"},
                      {"question": "2+2?", "answer": "4"}])
  with pytest.raises(data.DataError) as e:
    data.load_questions(str(path))
  assert str(e.value) == (f"{path}: row 1, column 'answer': no '#### <number>' final answer "
                          "in '4' (read as GSM8K: answers in this file hold '####')")


def test_unreadable_jsonl_lines_name_file_line_and_row_and_can_be_skipped(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_bytes(b'{"problem": "1+1?", "answer": "2"}\n\n'
                   b'{"problem": "caf\xe9?", "answer": "1"}\n'
                   b'{"problem": "3+3?", "answer": \n'
                   b'["not", "an", "object"]\n'
                   b'{"problem": "4+4?", "answer": "8"}\n')
  with pytest.raises(data.DataError) as e:
    data.load_questions(str(path))
  assert str(e.value) == (f"{path}: row 1, line 3: byte 0xe9 at offset 16 is not UTF-8")
  loaded = data.load_questions(str(path), skip_bad_rows=True)
  assert [(q.uid, q.ground_truth) for q in loaded.questions] == [(0, "2"), (4, "8")]
  assert loaded.skipped[1:] == [
      f"{path}: row 2, line 4 is not valid JSON: Expecting value (column 31)",
      f"{path}: row 3, line 5 is not a JSON object"]


def test_bad_json_files_and_columns_are_one_line(tmp_path):
  path = tmp_path / "rows.json"
  path.write_bytes(b'[\n{"problem": "x", "answer": "1"},\n{"problem": "\xff"}\n]')
  with pytest.raises(data.DataError, match=r"rows\.json: line 3: byte 0xff at offset"):
    data.load_questions(str(path))
  path.write_text('[{"problem": "x", "answer": "1"},\n {"problem": }]')
  with pytest.raises(data.DataError, match=r"rows\.json: line 2 is not valid JSON"):
    data.load_questions(str(path))
  path.write_text('{"problem": "x"}')
  with pytest.raises(data.DataError, match=r"rows\.json: expected a JSON array"):
    data.load_questions(str(path))
  wrong = tmp_path / "wrong.parquet"
  pd.DataFrame({"text": ["a"], "label": [1]}).to_parquet(wrong)
  with pytest.raises(data.DataError) as e:
    data.load_questions(str(wrong))
  assert str(e.value).startswith(f"{wrong}: unrecognised schema (columns: label, text); "
                                 "expected verl")
  trl = tmp_path / "trl.jsonl"
  _write_jsonl(trl, [{"prompt": "x?"}, {"prompt": "y?", "reward": 1}])
  with pytest.raises(data.DataError) as e:  # a prompt alone is read as verl
    data.load_questions(str(trl))
  assert "missing column 'data_source' for the verl schema" in str(e.value)
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(data.DataError, match=r"x\.csv: unknown data format"):
    data.load_questions(str(tmp_path / "x.csv"))
  (tmp_path / "junk.parquet").write_text("not parquet")
  with pytest.raises(data.DataError, match=r"junk\.parquet: not a readable parquet file"):
    data.load_questions(str(tmp_path / "junk.parquet"))


def test_empty_user_message_is_an_error_naming_the_row(tmp_path):
  frame = _verl_frame()
  frame.at[2, "prompt"] = [{"role": "user", "content": "  "}]
  frame.to_parquet(tmp_path / "empty.parquet")
  with pytest.raises(data.DataError) as e:
    data.load_questions(str(tmp_path / "empty.parquet"))
  assert str(e.value) == f"{tmp_path}/empty.parquet: row 2, column 'prompt': empty user message"
  _write_jsonl(tmp_path / "empty.jsonl", [{"prompt": "", "answer": "1"}])
  with pytest.raises(data.DataError, match=r"row 0, column 'prompt': empty text"):
    data.load_questions(str(tmp_path / "empty.jsonl"))


def test_datasets_directories(tmp_path):
  datasets = pytest.importorskip("datasets", reason="the optional `data` extra is not installed")
  frame = _verl_frame()
  datasets.Dataset.from_pandas(frame).save_to_disk(str(tmp_path / "one"))
  expected = _summary(data.load_questions(str(tmp_path / "one")))
  assert [q[2] for q in expected] == ["1", "2", "3", "4"]
  datasets.DatasetDict({"train": datasets.Dataset.from_pandas(frame[:2]),
                        "test": datasets.Dataset.from_pandas(frame[2:])}).save_to_disk(
                            str(tmp_path / "dict"))
  assert [q.ground_truth for q in data.load_questions("dict@test", data_dir=str(tmp_path))
          .questions] == ["3", "4"]
  assert len(data.load_questions(str(tmp_path / "dict")).questions) == 2  # train
  with pytest.raises(data.DataError, match=r"dict: no split 'dev' \(splits: train, test\)"):
    data.load_questions(f"{tmp_path}/dict@dev")
  (tmp_path / "plain" / "state.json").parent.mkdir()
  (tmp_path / "plain" / "state.json").write_text("{}")
  with pytest.raises(data.DataError, match=r"plain: not a `datasets` save_to_disk directory"):
    data.load_questions(str(tmp_path / "plain"))


def test_a_directory_of_data_files_is_read_without_datasets(tmp_path):
  frame = _verl_frame()
  snapshot = tmp_path / "snapshot"
  snapshot.mkdir()
  frame[:2].to_parquet(snapshot / "train-00000-of-00002.parquet")
  frame[2:3].to_parquet(snapshot / "train-00001-of-00002.parquet")
  frame[3:].to_parquet(snapshot / "test-00000-of-00001.parquet")
  (snapshot / "README.md").write_text("a hub snapshot")
  train = data.load_questions(str(snapshot)).questions
  assert [q.ground_truth for q in train] == ["1", "2", "3"]  # train* by default, in order
  assert [q.ground_truth for q in data.load_questions(f"{snapshot}@test").questions] == ["4"]
  with pytest.raises(data.DataError, match=r"snapshot@dev: no data file named dev\* \(it "
                                           r"holds test-00000-of-00001.parquet, train-"):
    data.load_questions(f"{snapshot}@dev")
  rows = tmp_path / "rows"
  rows.mkdir()
  frame[:1].to_json(rows / "a.jsonl", orient="records", lines=True)
  frame[1:2].to_json(rows / "b.jsonl", orient="records", lines=True)
  assert [q.ground_truth for q in data.load_questions(str(rows)).questions] == ["1", "2"]
  pd.DataFrame({"question": ["x"]}).to_json(rows / "c.jsonl", orient="records", lines=True)
  with pytest.raises(data.DataError, match=r"c.jsonl: columns \['question'\] differ from "):
    data.load_questions(str(rows))
  other = tmp_path / "other"
  other.mkdir()
  (other / "notes.txt").write_text("")
  with pytest.raises(data.DataError, match=r"other: a directory with no data files \(.parquet, "
                                           r".jsonl, .json\), nor a `datasets` save_to_disk "
                                           r"directory; it holds notes.txt"):
    data.load_questions(str(other))


def test_hub_names(monkeypatch):
  assert readers.parse_hub_name("hf:openai/gsm8k/main@test") == ("openai/gsm8k", "main", "test")
  assert readers.parse_hub_name("hf:Elliott/Openr1-Math-46k-8192") == (
      "Elliott/Openr1-Math-46k-8192", None, "train")
  with pytest.raises(data.DataError, match=r"hf:gsm8k: expected hf:OWNER/NAME"):
    data.load_questions("hf:gsm8k")
  assert readers.missing("hf:openai/gsm8k") is None
  try:
    import datasets  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    with pytest.raises(data.DataError, match=r"needs the `datasets` package: pip install"):
      data.load_questions("hf:openai/gsm8k/main@test")
    return
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  with pytest.raises(data.DataError) as e:
    data.load_questions("hf:nobody-here/no-such-dataset")
  assert str(e.value).startswith(
      "hf:nobody-here/no-such-dataset: cannot load it from the Hugging Face hub (")
  assert "\n" not in str(e.value)


def test_train_reports_bad_data_in_one_line(tmp_path):
  path = tmp_path / "broken.jsonl"
  path.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": \n')
  # A relative train_path: read from the working directory.
  result = subprocess.run(
      [sys.executable, "-m", "exgrpo_jax.train",
       f"--config={conftest.REPO_ROOT}/configs/tiny.py", f"--workdir={tmp_path / 'run'}",
       "--config.data.source=file", "--config.data.train_path=broken.jsonl"],
      cwd=tmp_path, capture_output=True, text=True, timeout=600,
      env=conftest.subprocess_env(JAX_PLATFORMS="cpu"))
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      f"exgrpo_jax.train: {path}: row 1, line 2 is not valid JSON: Expecting value "
      "(column 13)")
  assert "Traceback" not in result.stderr


def test_eval_data_paths_try_the_working_directory_then_the_data_dir(tmp_path, monkeypatch,
                                                                     capsys):
  from exgrpo_jax import eval as eval_cli  # pylint: disable=g-import-not-at-top
  (tmp_path / "prepared").mkdir()
  _write_jsonl(tmp_path / "prepared" / "toy.jsonl", [{"problem": "1+1?", "answer": "2"}])
  _write_jsonl(tmp_path / "local.jsonl", [{"question": "2+2?", "answer": "4"}])
  monkeypatch.setenv(readers.ENV_VAR, str(tmp_path / "prepared"))
  monkeypatch.chdir(tmp_path)
  # Both files are found; the source filter then leaves nothing (before any model loads).
  assert eval_cli.main(["--data", "toy.jsonl", "--data", "local.jsonl", "--sources", "x"]) == 1
  assert "error: no questions selected from ['toy.jsonl', 'local.jsonl']" in (
      capsys.readouterr().err)
  assert eval_cli.main(["--data", "nope.parquet"]) == 1
  assert capsys.readouterr().err.startswith(
      f"error: nope.parquet: no such file in the working directory ({tmp_path}) or the data "
      f"directory (data.dir='{tmp_path}/prepared')")
