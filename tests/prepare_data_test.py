"""prepare_data on hub-shaped tables built from the shared files; only the download is fake."""

import os
import shutil

import pandas as pd
import pytest

from exgrpo_jax import data
from exgrpo_jax import prepare_data


def _hub_gsm8k(shared, split):
  """openai/gsm8k's columns: question, answer."""
  return pd.read_parquet(os.path.join(shared, f"gsm8k_{split}.parquet"))[["question", "answer"]]


def _hub_math(shared, split):
  """DigitalLearningGmbH/MATH-lighteval's columns: problem, level, solution, type."""
  frame = pd.read_parquet(os.path.join(shared, f"math_{split}.parquet"))
  suffix = " " + data.BOXED_INSTRUCTION
  problems = [p[0]["content"] for p in frame["prompt"]]
  assert all(p.endswith(suffix) for p in problems)
  return pd.DataFrame({
      "problem": [p[:-len(suffix)] for p in problems], "level": frame["level"],
      "solution": [f"Working. The answer is $\\boxed{{{r['ground_truth']}}}$."
                   for r in frame["reward_model"]],
      "type": frame["type"]})


@pytest.fixture
def fake_download(shared_data_dir, monkeypatch):
  calls = []

  def download(source, path):
    calls.append(source)
    if source == "hf:openai/gsm8k/main@test":
      _hub_gsm8k(shared_data_dir, "test").to_parquet(path)
    elif source == "hf:DigitalLearningGmbH/MATH-lighteval@test":
      _hub_math(shared_data_dir, "test").to_parquet(path)
    elif source.endswith("/ExGRPO/data/valid.parquet"):
      shutil.copy(os.path.join(shared_data_dir, "exgrpo_valid.parquet"), path)
    elif source == "hf:Elliott/Openr1-Math-46k-8192@train":  # verl rows with R1 traces
      frame = pd.read_parquet(os.path.join(shared_data_dir, "exgrpo_valid.parquet"))[:50]
      frame["target"] = [[{"role": "assistant", "content": "<think>...</think> 1"}]] * 50
      frame.to_parquet(path)
    else:
      raise OSError(f"<urlopen error [Errno 101] Network is unreachable> ({source})")

  monkeypatch.setattr(prepare_data, "download", download)
  return calls


def _fields(questions):
  return [(q.messages, q.ground_truth, q.data_source, q.reward_name) for q in questions]


def test_prepared_files_read_back_as_the_originals(shared_data_dir, fake_download, tmp_path):
  names = ["gsm8k_test", "math_test", "exgrpo_valid", "openr1_math_46k"]
  assert prepare_data.main(["--out", str(tmp_path), "--datasets", *names]) == 0
  assert len(fake_download) == 4
  for name in names:
    frame = pd.read_parquet(tmp_path / f"{name}.parquet")
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info"} <= set(frame)
  original = lambda name: data.load_questions(os.path.join(shared_data_dir, f"{name}.parquet"))
  prepared = lambda name: data.load_questions(f"{name}.parquet", data_dir=str(tmp_path))

  gsm8k = prepared("gsm8k_test").questions
  assert _fields(gsm8k) == _fields(original("gsm8k_test").questions)
  assert gsm8k[0].reward_name == "gsm8k" and gsm8k[0].extra["extra_info"] == {
      "index": 0, "split": "test"}
  assert gsm8k[0].extra["solution"].endswith("#### 18")

  math = prepared("math_test").questions
  reference = original("math_test").questions
  assert _fields(math) == _fields(reference) and len(math) == 5000
  assert [(q.extra["level"], q.extra["type"], q.extra["extra_info"]) for q in math] == [
      (q.extra["level"], q.extra["type"], q.extra["extra_info"]) for q in reference]

  assert prepared("exgrpo_valid").questions == original("exgrpo_valid").questions
  openr1 = prepared("openr1_math_46k").questions
  assert _fields(openr1) == _fields(original("exgrpo_valid").questions[:50])
  assert "target" not in pd.read_parquet(tmp_path / "openr1_math_46k.parquet")

  # Present files are kept unless --force.
  assert prepare_data.main(["--out", str(tmp_path), "--datasets", "gsm8k_test"]) == 0
  assert len(fake_download) == 4
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".download-")]


def test_failed_downloads_are_one_line_each_and_the_rest_is_written(fake_download, tmp_path,
                                                                    capsys):
  code = prepare_data.main(["--out", str(tmp_path), "--datasets", "gsm8k_train",
                            "gsm8k_test"])
  assert code == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["prepare_data: gsm8k_train: <urlopen error [Errno 101] Network is "
                 "unreachable> (hf:openai/gsm8k/main@train)",
                 "prepare_data: failed: gsm8k_train"]
  assert sorted(os.listdir(tmp_path)) == ["gsm8k_test.parquet"]


def test_a_download_with_the_wrong_columns_names_the_file(monkeypatch, tmp_path, capsys):
  monkeypatch.setattr(prepare_data, "download", lambda source, path: pd.DataFrame(
      {"text": ["x"]}).to_parquet(path))
  assert prepare_data.main(["--out", str(tmp_path), "--datasets", "math_test"]) == 1
  [line, _] = capsys.readouterr().err.strip().splitlines()
  assert line.startswith("prepare_data: math_test: ") and "unrecognised schema" in line
  assert line.endswith("problem (problem, answer or solution)")


def test_every_config_data_path_is_a_prepared_name():
  import importlib  # pylint: disable=g-import-not-at-top
  for name in ("qwen7b", "qwen1_5b", "qwen7b_instruct", "llama8b", "llama8b_instruct"):
    c = importlib.import_module(f"configs.{name}").get_config()
    for path in (c.data.train_path, c.eval.path):
      assert path.endswith(".parquet") and path[:-len(".parquet")] in prepare_data.RECIPES


def test_an_unusable_output_directory_is_one_line(tmp_path, capsys):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  assert prepare_data.main(["--out", str(blocker / "data"), "--datasets", "gsm8k_test"]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("prepare_data: ") and "a_file" in err[0], err
