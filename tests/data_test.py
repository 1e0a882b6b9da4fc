"""Readers on every shared data file and on broken ones, templates, the question stream."""

import json
import os

import numpy as np
import pandas as pd
import pytest

from exgrpo_jax import data

# Rows per file (data/README.md); math_train.parquet has two rows with an empty ground
# truth, which are skipped and counted.
ROWS = {"exgrpo_test_id.parquet": 6023, "exgrpo_valid.parquet": 2259,
        "ood_arc_c.parquet": 1172, "ood_gpqa_diamond.parquet": 198,
        "math_train.parquet": 7500, "math_test.parquet": 5000,
        "gsm8k_train.parquet": 7473, "gsm8k_test.parquet": 1319}
EMPTY_TRUTH = {"math_train.parquet": 2}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_every_shared_file_loads(shared_data_dir, name):
  path = os.path.join(shared_data_dir, name)
  loaded = data.load_questions(path)
  skipped = EMPTY_TRUTH.get(name, 0)
  assert len(loaded.questions) == ROWS[name] - skipped
  assert len(loaded.skipped) == skipped
  assert all("reward_model.ground_truth" in m and "empty" in m for m in loaded.skipped)
  uids = [q.uid for q in loaded.questions]
  assert uids == sorted(set(uids)) and uids[-1] == ROWS[name] - 1  # row index in the file
  assert all(q.ground_truth.strip() and q.problem.strip() for q in loaded.questions)


def test_verl_rows_match_pandas(shared_data_dir):
  path = os.path.join(shared_data_dir, "exgrpo_test_id.parquet")
  frame = pd.read_parquet(path)
  questions = data.load_questions(path).questions
  for i in (0, 1234, 6022):
    row, q = frame.iloc[i], questions[i]
    assert q.uid == i
    assert q.ground_truth == row["reward_model"]["ground_truth"]
    assert q.data_source == row["data_source"]
    assert [m["content"] for m in q.messages] == [m["content"] for m in row["prompt"]]
    assert q.extra["extra_info"] == {"index": row["extra_info"]["index"], "split": "default"}
  assert questions[0].ground_truth == "\\left( 3, \\frac{\\pi}{2} \\right)"
  assert questions[0].messages[0]["content"] == data.EXGRPO_SYSTEM_PROMPT
  assert {q.reward_name for q in questions} == {"math_verify"}


def test_reward_routing_and_gsm8k_answers(shared_data_dir):
  arc = data.load_questions(os.path.join(shared_data_dir, "ood_arc_c.parquet"), limit=3)
  assert [q.reward_name for q in arc.questions] == ["multiple_choice"] * 3
  assert arc.questions[0].ground_truth == "C"
  gsm = data.load_questions(os.path.join(shared_data_dir, "gsm8k_test.parquet")).questions
  assert gsm[0].ground_truth == "18" and gsm[0].reward_name == "gsm8k"
  assert gsm[0].problem.startswith("Janet’s ducks lay 16 eggs per day.")
  assert gsm[0].problem.endswith(data.BOXED_INSTRUCTION)
  with_comma = [q for q in gsm if q.extra["solution"].endswith("#### 2,125")]
  assert [q.ground_truth for q in with_comma] == ["2125"]
  forced = data.load_questions(os.path.join(shared_data_dir, "gsm8k_test.parquet"), limit=2,
                               reward_name="math_verify")
  assert [q.reward_name for q in forced.questions] == ["math_verify"] * 2


def _verl_frame(n=5):
  return pd.DataFrame({
      "data_source": ["toy"] * n,
      "prompt": [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(n)],
      "reward_model": [{"ground_truth": str(i + 1), "style": "rule"} for i in range(n)],
  })


def test_missing_column_names_file_and_column(tmp_path):
  path = str(tmp_path / "no_reward.parquet")
  _verl_frame().drop(columns=["reward_model"]).to_parquet(path)
  with pytest.raises(data.DataError, match=r"no_reward\.parquet: missing column 'reward_model'"):
    data.load_questions(path, skip_bad_rows=True)  # a missing column is never skippable


def test_null_ground_truth_error_or_counted_skip(tmp_path):
  frame = _verl_frame()
  frame.at[3, "reward_model"] = {"ground_truth": None, "style": "rule"}
  path = str(tmp_path / "null_gt.parquet")
  frame.to_parquet(path)
  with pytest.raises(data.DataError) as e:
    data.load_questions(path)
  assert str(e.value) == f"{path}: row 3, column 'reward_model.ground_truth': null value"
  loaded = data.load_questions(path, skip_bad_rows=True)
  assert [q.uid for q in loaded.questions] == [0, 1, 2, 4]  # uids stay row indices
  assert loaded.skipped == [str(e.value)]


def test_bad_prompt_and_gsm8k_rows(tmp_path):
  frame = _verl_frame()
  frame.at[1, "prompt"] = [{"role": "system", "content": "only a system prompt"}]
  path = str(tmp_path / "no_user.parquet")
  frame.to_parquet(path)
  with pytest.raises(data.DataError, match=r"row 1, column 'prompt': no user message"):
    data.load_questions(path)
  gsm = pd.DataFrame({"question": ["a?", "b?"], "answer": ["so 4\n#### 4", "no final answer"]})
  path = str(tmp_path / "gsm.parquet")
  gsm.to_parquet(path)
  with pytest.raises(data.DataError, match=r"gsm\.parquet: row 1, column 'answer': no '####"):
    data.load_questions(path)
  assert [q.ground_truth for q in data.load_questions(path, skip_bad_rows=True).questions] == [
      "4"]


def test_jsonl(tmp_path):
  path = tmp_path / "extra_math.jsonl"
  rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "Half of 1?", "answer": 0.5},
          {"problem": "3*3?", "answer": None}]
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
  with pytest.raises(data.DataError, match=r"extra_math\.jsonl: row 2, column 'answer'"):
    data.load_questions(str(path))
  loaded = data.load_questions(str(path), skip_bad_rows=True)
  assert [(q.uid, q.ground_truth, q.data_source, q.reward_name) for q in loaded.questions] == [
      (0, "2", "extra_math", "math_verify"), (1, "0.5", "extra_math", "math_verify")]
  path.write_text('{"problem": "x"}\n')
  with pytest.raises(data.DataError, match="missing column 'answer'"):
    data.load_questions(str(path))
  path.write_text('{"problem": "x", "answer": "1"}\n{not json\n')
  with pytest.raises(data.DataError, match="line 2 .* not valid JSON"):
    data.load_questions(str(path))


# --- templates -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
  from exgrpo_jax import models  # pylint: disable=g-import-not-at-top
  try:
    return models.load_tokenizer()
  except (FileNotFoundError, ImportError) as e:
    pytest.skip(f"embedded model unavailable: {e}")


@pytest.fixture(scope="module")
def test_id_questions(shared_data_dir):
  return data.load_questions(os.path.join(shared_data_dir, "exgrpo_test_id.parquet")).questions


def test_templates_render_as_specified(tokenizer, test_id_questions):
  q = test_id_questions[0]
  [chat], _ = data.render_prompts([q], tokenizer, "chat")
  assert chat.text == tokenizer.apply_chat_template(list(q.messages), tokenize=False,
                                                    add_generation_prompt=True)
  assert chat.ids == tuple(tokenizer(chat.text, add_special_tokens=False)["input_ids"])
  assert not chat.think_gate
  [no_sys], _ = data.render_prompts([q], tokenizer, "chat", remove_system=True)
  assert data.EXGRPO_SYSTEM_PROMPT not in no_sys.text and q.problem in no_sys.text
  [think], _ = data.render_prompts([q], tokenizer, "exgrpo_think")
  assert think.text.startswith("<|im_start|>system\n" + data.EXGRPO_SYSTEM_PROMPT)
  assert think.text.endswith(f"{q.problem}<|im_end|>\n<|im_start|>assistant\n<think>\n")
  assert think.think_gate
  [plain], _ = data.render_prompts([q], tokenizer, "plain")
  assert plain.text == f"User: {q.problem}\nAssistant:" and not plain.think_gate
  with pytest.raises(KeyError, match="unknown prompt template 'nope'"):
    data.render_prompts([q], tokenizer, "nope")


def test_long_prompts_are_dropped_and_counted(tokenizer, test_id_questions):
  questions = test_id_questions[:600]
  prompts, dropped = data.render_prompts(questions, tokenizer, "chat")
  lengths = np.array([len(p.ids) for p in prompts])
  limit = int(np.median(lengths))
  kept, dropped = data.render_prompts(questions, tokenizer, "chat", max_prompt_tokens=limit)
  assert dropped == int((lengths > limit).sum()) > 0
  assert [p.question.uid for p in kept] == [p.question.uid for p in prompts
                                            if len(p.ids) <= limit]


# --- the question stream -------------------------------------------------------------

def _questions(n):
  return [data.Question(uid=10 * i, messages=({"role": "user", "content": str(i)},),
                        ground_truth="0", data_source="toy", reward_name="math_verify")
          for i in range(n)]


def _drive(stream, steps, first_step=0):
  """A trainer-like pattern: take 5, put 2 back, on odd steps retire one."""
  served = []
  for step in range(first_step, first_step + steps):
    batch = [q.uid for q in stream.next_batch(5)]
    stream.put_back(batch[3:])
    if step % 2:
      stream.retire(batch[:1])
    served.append(batch)
  return served


def test_stream_state_round_trips_through_json():
  questions = _questions(40)
  reference = data.QuestionStream(questions, seed=7)
  expected = _drive(reference, 30)
  assert reference.epoch >= 2 and all(len(b) == 5 for b in expected)
  first = data.QuestionStream(questions, seed=7)
  served = _drive(first, 11)
  state = json.loads(json.dumps(first.state_dict()))
  resumed = data.QuestionStream(questions, seed=123)  # the seed comes from the state
  resumed.load_state_dict(state)
  served += _drive(resumed, 19, first_step=11)
  assert served == expected
  fresh = data.QuestionStream(questions, seed=7)  # without the state: a different run
  assert _drive(fresh, 19, first_step=11) != expected[11:]


def test_stream_epochs_shuffle_deterministically_and_cover_everything():
  questions = _questions(12)
  a, b = data.QuestionStream(questions, seed=1), data.QuestionStream(questions, seed=1)
  epochs = [[q.uid for q in a.next_batch(12)] for _ in range(3)]
  assert epochs == [[q.uid for q in b.next_batch(12)] for _ in range(3)]
  assert all(sorted(e) == [q.uid for q in questions] for e in epochs)
  assert epochs[0] != epochs[1]  # reshuffled per epoch
  other = [q.uid for q in data.QuestionStream(questions, seed=2).next_batch(12)]
  assert other != epochs[0]


def test_stream_put_back_retire_and_epoch_boundaries():
  questions = _questions(7)
  stream = data.QuestionStream(questions, seed=0)
  first = [q.uid for q in stream.next_batch(5)]
  stream.put_back(first[3:])
  second = [q.uid for q in stream.next_batch(5)]
  assert second[:2] == first[3:]  # returned questions come first
  assert len(set(second)) == 5  # crossing into epoch 1 never repeats a question
  stream.retire([first[0], second[-1]])
  assert stream.num_active == 5
  later = [q.uid for _ in range(6) for q in stream.next_batch(4)]
  assert first[0] not in later and second[-1] not in later
  stream.retire([q.uid for q in questions])
  assert stream.next_batch(3) == []
  with pytest.raises(KeyError, match="unknown question uids"):
    stream.put_back([5])
