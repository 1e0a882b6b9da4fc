"""`python -m exgrpo_jax.generate` on a tiny random model with the real tokenizer."""

import jax
import pytest

from exgrpo_jax import generate
from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax.models import export


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, text_model):
  cfg, params, tokenizer = text_model
  path = str(tmp_path_factory.mktemp("tiny"))
  export.save_pretrained(cfg, params, path)
  tokenizer.save_pretrained(path)
  return path


def test_prints_every_completion_as_the_engine_generates_it(tiny_dir, capsys):
  args = ["--model", tiny_dir, "--prompt", "Hi there", "--prompt", "What is 2 + 2?", "--chat",
          "--n", "2", "--max-new-tokens", "6", "--temperature", "0.8", "--seed", "3"]
  assert generate.main(args) == 0
  captured = capsys.readouterr()
  policy, tokenizer = models.from_pretrained(tiny_dir), models.load_tokenizer(tiny_dir)
  prompts = [generate.encode(tokenizer, p, chat=True) for p in ("Hi there", "What is 2 + 2?")]
  assert prompts[0][-3:] == tokenizer("<|im_start|>assistant\n")["input_ids"][-3:]
  out = sampling.make_engine("jax", policy.config, tokenizer).generate(
      prompts, 2, policy.params, jax.random.key(3),
      sampling.SamplingConfig(temperature=0.8, max_new_tokens=6))
  blocks = captured.out.split("=== prompt ")[1:]
  assert len(blocks) == 4
  for row, block in enumerate(blocks):
    header, text = block.split("\n", 1)
    assert header.startswith(f"{row // 2}, sample {row % 2} ({out.lengths_N[row]} tokens")
    assert text == out.texts[row] + "\n"
  assert "tokens/s" in captured.err and "compile" in captured.err


def test_max_rows_decodes_the_same_rows_in_fewer_slots(tiny_dir, capsys):
  """--max-rows 1: the 4 rows go one after another through 1 slot (continuous
  batching), and print as they do with every row at once."""
  args = ["--model", tiny_dir, "--prompt", "Hi there", "--prompt", "What is 2 + 2?",
          "--n", "2", "--max-new-tokens", "6", "--temperature", "0.8", "--seed", "3"]
  assert generate.main(args) == 0
  every_row = capsys.readouterr().out
  assert generate.main(args + ["--max-rows", "1"]) == 0
  assert capsys.readouterr().out == every_row
  with pytest.raises(SystemExit) as e:  # a bad flag: exit status 2
    generate.main(args + ["--max-rows", "-1"])
  assert e.value.code == 2
  assert capsys.readouterr().err.strip().splitlines()[-1] == (
      "python -m exgrpo_jax.generate: error: argument --max-rows/--max_rows: must be at "
      "least 0, got -1")


def test_bad_model_path_is_an_error_not_a_traceback(capsys):
  assert generate.main(["--model", "/nonexistent/model", "--prompt", "x"]) == 1
  assert "does not exist: /nonexistent/model" in capsys.readouterr().err
