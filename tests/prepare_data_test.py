"""prepare_data on hub-shaped tables built from the shared files; only the download is fake."""

import os
import re
import shutil
import urllib.error
import urllib.request

import pandas as pd
import pytest

from exgrpo_jax import data
from exgrpo_jax import prepare_data
from exgrpo_jax.data import readers
from exgrpo_jax.rewards import graders


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


# --- MMLU-Pro and ExGRPO's OOD file, from tiny stand-ins of their real formats ------------

OOD_USER = re.compile(r"(?s).+\n\n(?:[A-J]\) .*\n)+")  # question, blank line, "X) option"s


def _hub_mmlu_pro():
  """TIGER-Lab/MMLU-Pro's test columns and types (question_id, question, options, answer,
  answer_index, cot_content, category, src), three rows of ten, four and nine options."""
  return pd.DataFrame({
      "question_id": [70, 71, 12031],
      "question": ["Which of these is a prime number?", "What is 2 + 2?",
                   "Which gas makes up most of Earth's atmosphere?"],
      "options": [[str(n) for n in (4, 6, 8, 9, 10, 12, 14, 15, 16, 17)],
                  ["3", "4", "5", "22"],
                  ["Oxygen", "Argon", "Carbon dioxide", "Helium", "Hydrogen", "Neon",
                   "Methane", "Ozone", "Nitrogen"]],
      "answer": ["J", "B", "I"], "answer_index": [9, 1, 8], "cot_content": ["", "", ""],
      "category": ["math", "math", "chemistry"],
      "src": ["ori_mmlu-high_school_mathematics", "stemez-Math", "scibench-chemistry"]})


def _ood_rows(source, truths):
  """verl rows as in the reference's OOD files: system prompt, then options as "X) ..."."""
  return [dict(data_source=source, ability="math",
               prompt=[{"role": "system", "content": data.EXGRPO_SYSTEM_PROMPT},
                       {"role": "user", "content": f"Question {i}?\n\nA) x\nB) y\nC) z\nD) w\n"}],
               reward_model={"ground_truth": t, "style": "rule"},
               extra_info={"index": i, "split": "default"}) for i, t in enumerate(truths)]


@pytest.fixture
def fake_sources(monkeypatch, tmp_path):
  """The download replaced by the stand-ins of MMLU-Pro and test.ood.parquet."""
  ood = pd.DataFrame(_ood_rows("arc_c", "CA") + _ood_rows("gpqa", "BD")
                     + _ood_rows("mmlu_pro", "AJ"))

  def download(source, path):
    if source == "hf:TIGER-Lab/MMLU-Pro@test":
      _hub_mmlu_pro().to_parquet(path)
    elif source.endswith("/ExGRPO/data/test.ood.parquet"):
      ood.to_parquet(path)
    else:
      raise AssertionError(source)

  monkeypatch.setattr(prepare_data, "download", download)
  return ood


def test_mmlu_pro_is_prepared_as_the_reference_ood_files_are(fake_sources, tmp_path):
  assert prepare_data.main(["--out", str(tmp_path), "--datasets", "ood_mmlu_pro"]) == 0
  questions = data.load_questions("ood_mmlu_pro.parquet", data_dir=str(tmp_path)).questions
  hub = _hub_mmlu_pro()
  assert [q.ground_truth for q in questions] == ["J", "B", "I"]
  for q, (_, row) in zip(questions, hub.iterrows()):
    system, user = q.messages
    assert system == {"role": "system", "content": data.EXGRPO_SYSTEM_PROMPT}
    assert user["content"] == row["question"] + "\n\n" + "".join(
        f"{'ABCDEFGHIJ'[j]}) {option}\n" for j, option in enumerate(row["options"]))
    assert OOD_USER.fullmatch(user["content"])
    assert (q.data_source, q.reward_name) == ("mmlu_pro", "multiple_choice")
    assert (q.extra["category"], q.extra["src"], q.extra["question_id"]) == (
        row["category"], row["src"], row["question_id"])
  # The reward reads the letter as the reference's eval does, options up to J.
  assert graders.grade("... so the answer is \\boxed{J}", "J", "multiple_choice",
                       False) == (1.0, "ok")
  assert graders.grade("\\boxed{I}", "J", "multiple_choice", False) == (0.0, "ok")


def test_the_mmlu_pro_format_is_the_reference_arc_c_files(shared_data_dir, fake_sources,
                                                         tmp_path):
  """The real ARC-c file of the reference: same system prompt, same option lines."""
  arc = pd.read_parquet(os.path.join(shared_data_dir, "ood_arc_c.parquet"))
  letter_rows = [p for p, r in zip(arc["prompt"], arc["reward_model"])
                 if r["ground_truth"].isalpha()]
  assert {p[0]["content"] for p in letter_rows} == {data.EXGRPO_SYSTEM_PROMPT}
  assert all(OOD_USER.fullmatch(p[1]["content"]) for p in letter_rows)
  assert len(letter_rows) == 1150


def test_exgrpo_test_ood_is_taken_as_it_is(fake_sources, tmp_path, capsys):
  assert prepare_data.main(["--out", str(tmp_path), "--datasets", "exgrpo_test_ood"]) == 0
  assert "arc_c 2 graded by multiple_choice, gpqa 2 graded by multiple_choice, mmlu_pro 2 " \
         "graded by multiple_choice" in capsys.readouterr().out
  stand_in = tmp_path / "stand_in.parquet"
  fake_sources.to_parquet(stand_in)
  assert (data.load_questions("exgrpo_test_ood.parquet", data_dir=str(tmp_path)).questions
          == data.load_questions(str(stand_in)).questions)


@pytest.mark.parametrize("name", ["exgrpo_test_ood", "ood_mmlu_pro"])
def test_real_ood_files_when_present(shared_data_dir, name, tmp_path, monkeypatch):
  """A real prepared file in the shared data (none there yet): read back unchanged through
  the recipe that takes verl rows, every row a letter graded by multiple_choice."""
  path = os.path.join(shared_data_dir, f"{name}.parquet")
  if not os.path.exists(path):
    pytest.skip(f"{path} is not in the shared data")
  monkeypatch.setattr(prepare_data, "download", lambda source, dst: shutil.copy(path, dst))
  assert prepare_data.main(["--out", str(tmp_path), "--datasets", "exgrpo_test_ood"]) == 0
  prepared = data.load_questions("exgrpo_test_ood.parquet", data_dir=str(tmp_path)).questions
  assert prepared == data.load_questions(path).questions
  assert {q.reward_name for q in prepared} == {"multiple_choice"}
  assert all(q.ground_truth in "ABCDEFGHIJ" for q in prepared)


def test_a_bad_mmlu_pro_row_is_one_line(monkeypatch, tmp_path, capsys):
  frame = _hub_mmlu_pro()
  frame.loc[1, "answer"] = "E"  # only four options
  monkeypatch.setattr(prepare_data, "download", lambda source, path: frame.to_parquet(path))
  assert prepare_data.main(["--out", str(tmp_path), "--datasets", "ood_mmlu_pro"]) == 1
  assert capsys.readouterr().err.strip().splitlines()[0] == (
      "prepare_data: ood_mmlu_pro: MMLU-Pro row 1 (question_id 71): answer 'E' / "
      "answer_index 1 do not name one of its 4 options")


def test_an_unreachable_source_names_its_url(monkeypatch, tmp_path, capsys):
  def no_network(url, path):
    raise urllib.error.URLError(OSError(101, "Network is unreachable"))

  def no_hub(source):
    raise ConnectionError("Couldn't reach 'TIGER-Lab/MMLU-Pro' on the Hub (LocalEntryNotFound)")

  monkeypatch.setattr(urllib.request, "urlretrieve", no_network)  # the download calls
  monkeypatch.setattr(readers, "load_hub", no_hub)
  assert prepare_data.main(["--out", str(tmp_path), "--datasets", "exgrpo_test_ood",
                            "ood_mmlu_pro"]) == 1
  assert capsys.readouterr().err.strip().splitlines() == [
      "prepare_data: exgrpo_test_ood: cannot download https://github.com/ElliottYan/LUFFY/"
      "raw/main/ExGRPO/data/test.ood.parquet: <urlopen error [Errno 101] Network is "
      "unreachable>",
      "prepare_data: ood_mmlu_pro: cannot download https://huggingface.co/datasets/"
      "TIGER-Lab/MMLU-Pro: Couldn't reach 'TIGER-Lab/MMLU-Pro' on the Hub "
      "(LocalEntryNotFound)",
      "prepare_data: failed: exgrpo_test_ood, ood_mmlu_pro"]
