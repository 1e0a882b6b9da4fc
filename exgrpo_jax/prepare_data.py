"""Downloads the paper's data and writes it in the verl parquet schema the configs read.

  pip install -e ".[data]"                 # Hugging Face `datasets`
  python -m exgrpo_jax.prepare_data        # every set below, into the data directory
  python -m exgrpo_jax.prepare_data --out DIR --datasets openr1_math_46k exgrpo_valid

`--out` defaults to the data directory (`$EXGRPO_DATA_DIR`, else
`~/.cache/exgrpo_jax/data`), where configs with `data.dir` unset look for their files, so
the paper configs (`configs/qwen7b.py`, ...) run after this with no data flags. Each set is
read through the same readers as training data (`exgrpo_jax.data`), so a download whose
columns are not what they should be fails here, naming the row, not mid-run. Written
columns: `data_source`, `prompt` (chat messages), `ability`, `reward_model` {`ground_truth`,
`style`}, `extra_info` {`index`, `split`}, plus the source's scalar fields (MATH's
`level` and `type`, GSM8K's `solution`); the R1 traces of OpenR1-Math are not kept (only
questions and ground truths are used, as in the reference).

The paper's out-of-distribution benchmarks are ARC-c, GPQA-Diamond and MMLU-Pro. ARC-c
and GPQA-Diamond are the reference repository's files. MMLU-Pro (`ood_mmlu_pro`) is the
hub's TIGER-Lab/MMLU-Pro test split (12,032 questions, up to ten options A-J) written as
the reference's OOD files are: the ExGRPO system prompt, then the question, a blank line
and one "X) option" line per option; the ground truth is the letter, graded by the
`multiple_choice` reward (the reference's eval drops the system prompt and grades the
letter in the last \boxed{}, which that reward reads first). `exgrpo_test_ood` is
ExGRPO's own OOD test file (ExGRPO/data/test.ood.parquet), taken as it is. A source that
cannot be reached is one line naming its URL.
"""

import argparse
import collections
import dataclasses
import os
import shutil
import sys
import tempfile
import urllib.request
from typing import Callable

import pandas as pd

from exgrpo_jax import cli
from exgrpo_jax import data
from exgrpo_jax.data import readers

# ExGRPO's evaluation sets are files in the reference repository (ElliottYan/LUFFY).
_LUFFY = "https://github.com/ElliottYan/LUFFY/raw/main"


@dataclasses.dataclass(frozen=True)
class Recipe:
  """One prepared file: where its rows come from, and its data_source when rows lack one."""

  source: str       # hf:OWNER/NAME[/CONFIG]@SPLIT, or the URL of a verl parquet file
  split: str        # extra_info.split for rows that have no extra_info
  about: str
  data_source: str = ""
  # The downloaded table -> one the readers take (for sources with their own columns).
  convert: Callable[[pd.DataFrame], pd.DataFrame] | None = None


OPTION_LETTERS = "ABCDEFGHIJ"


def mmlu_pro_frame(frame: pd.DataFrame) -> pd.DataFrame:
  """TIGER-Lab/MMLU-Pro rows (question, options, answer, answer_index, category, src,
  question_id) as verl rows in the format of the reference's OOD files (module docstring).
  """
  missing = [c for c in ("question", "options", "answer", "answer_index") if c not in frame]
  if missing:
    raise data.DataError(f"MMLU-Pro table: missing column {missing[0]!r} (columns: "
                         f"{', '.join(map(str, frame.columns))})")
  rows = []
  for i, row in enumerate(frame.to_dict("records")):
    options, answer = list(() if row["options"] is None else row["options"]), row["answer"]
    letters = list(OPTION_LETTERS[:len(options)])
    if not options or len(options) > len(OPTION_LETTERS) or answer not in letters or (
        letters.index(answer) != row["answer_index"]):
      raise data.DataError(f"MMLU-Pro row {i} (question_id {row.get('question_id')}): answer "
                           f"{answer!r} / answer_index {row['answer_index']} do not name "
                           f"one of its {len(options)} options")
    user = f"{row['question']}\n\n" + "".join(
        f"{letter}) {option}\n" for letter, option in zip(letters, options))
    rows.append(dict(
        data_source="mmlu_pro",
        prompt=[{"role": "system", "content": data.EXGRPO_SYSTEM_PROMPT},
                {"role": "user", "content": user}],
        ability="mmlu_pro", reward_model={"ground_truth": answer, "style": "rule"},
        extra_info={"index": i, "split": "test"},
        **{k: row[k] for k in ("category", "src", "question_id") if k in row}))
  return pd.DataFrame(rows)


RECIPES = {
    "openr1_math_46k": Recipe("hf:Elliott/Openr1-Math-46k-8192@train", "train",
                              "ExGRPO's training set (the reference's OpenR1-Math subset)"),
    "exgrpo_valid": Recipe(f"{_LUFFY}/ExGRPO/data/valid.parquet", "default",
                           "ExGRPO's validation set (AIME24/25, AMC, MATH-500, Minerva, "
                           "OlympiadBench)"),
    "exgrpo_test_id": Recipe(f"{_LUFFY}/ExGRPO/data/test.id.parquet", "default",
                             "ExGRPO's in-distribution test set"),
    "ood_arc_c": Recipe(f"{_LUFFY}/data/valid.arc_c.parquet", "default",
                        "ARC-Challenge (out of distribution)"),
    "ood_gpqa_diamond": Recipe(f"{_LUFFY}/data/valid.gpqa.parquet", "default",
                               "GPQA-Diamond (out of distribution)"),
    "ood_mmlu_pro": Recipe("hf:TIGER-Lab/MMLU-Pro@test", "test",
                           "MMLU-Pro (out of distribution), in the format of the other OOD "
                           "files", convert=mmlu_pro_frame),
    "exgrpo_test_ood": Recipe(f"{_LUFFY}/ExGRPO/data/test.ood.parquet", "default",
                              "ExGRPO's out-of-distribution test set (ARC-c, GPQA-Diamond, "
                              "MMLU-Pro)"),
    "gsm8k_train": Recipe("hf:openai/gsm8k/main@train", "train", "GSM8K train", "gsm8k"),
    "gsm8k_test": Recipe("hf:openai/gsm8k/main@test", "test", "GSM8K test", "gsm8k"),
    "math_train": Recipe("hf:DigitalLearningGmbH/MATH-lighteval@train", "train",
                         "Hendrycks MATH train", "DigitalLearningGmbH/MATH-lighteval"),
    "math_test": Recipe("hf:DigitalLearningGmbH/MATH-lighteval@test", "test",
                        "Hendrycks MATH test", "DigitalLearningGmbH/MATH-lighteval"),
}


def source_url(source: str) -> str:
  """The URL a recipe's rows come from (a hub dataset's page)."""
  if source.startswith(readers.HUB_PREFIX):
    return f"https://huggingface.co/datasets/{readers.parse_hub_name(source)[0]}"
  return source


def download(source: str, path: str) -> None:
  """Writes the rows of `source` (a hub split or a URL) to the file `path` (network); an
  OSError naming the URL when it cannot."""
  try:
    if source.startswith(readers.HUB_PREFIX):
      readers.load_hub(source).to_parquet(path)
    else:
      urllib.request.urlretrieve(source, path)
  except (OSError, ValueError) as e:  # unreachable, not found, no `datasets`
    raise OSError(f"cannot download {source_url(source)}: {cli.one_line(e)}") from None


def verl_frame(questions, split: str) -> pd.DataFrame:
  """Questions as a verl parquet table (see the module docstring for the columns)."""
  rows = []
  for q in questions:
    extra = dict(q.extra)
    row = dict(data_source=q.data_source, prompt=list(q.messages),
               ability=extra.pop("ability", "math"),
               reward_model={"ground_truth": q.ground_truth, "style": "rule"},
               extra_info=extra.pop("extra_info", None) or {"index": q.uid, "split": split})
    row.update((k, v) for k, v in extra.items() if isinstance(v, (str, int, float, bool)))
    rows.append(row)
  return pd.DataFrame(rows)


def prepare(name: str, out_dir: str, scratch: str) -> str:
  """Downloads, checks and converts one of RECIPES; returns a one-line summary."""
  recipe = RECIPES[name]
  raw = os.path.join(scratch, f"{name}.parquet")
  download(recipe.source, raw)
  if recipe.convert:
    recipe.convert(pd.read_parquet(raw)).to_parquet(raw)
  loaded = data.load_questions(raw, skip_bad_rows=True)
  questions = loaded.questions
  if recipe.data_source:
    questions = [dataclasses.replace(q, data_source=recipe.data_source) for q in questions]
  if not questions:
    raise data.DataError(f"{recipe.source}: no usable rows")
  target = os.path.join(out_dir, f"{name}.parquet")
  verl_frame(questions, recipe.split).to_parquet(raw + ".verl")
  os.replace(raw + ".verl", target)
  sources = collections.Counter((q.data_source, q.reward_name) for q in questions)
  return (f"{target}: {len(questions)} questions from {recipe.source} "
          f"({len(loaded.skipped)} unusable rows skipped; " + ", ".join(
              f"{source} {n} graded by {reward}" for (source, reward), n in sources.items())
          + ")")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      epilog="datasets: " + "; ".join(f"{k}: {r.about}" for k, r in RECIPES.items()))
  p.add_argument("--out", default="", help="output directory (default: the data directory, "
                 f"${readers.ENV_VAR} or ~/.cache/exgrpo_jax/data)")
  p.add_argument("--datasets", nargs="+", choices=sorted(RECIPES), default=list(RECIPES),
                 metavar="NAME", help="which sets (default: all)")
  p.add_argument("--force", action="store_true", help="replace files already there")
  cli.add_debug_flag(p)
  return p


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  return cli.guarded(lambda: _prepare(args), debug=args.debug, prefix="prepare_data")


def _prepare(args) -> int:
  out_dir = os.path.abspath(os.path.expanduser(args.out or readers.default_dir()))
  os.makedirs(out_dir, exist_ok=True)
  failed = []
  scratch = tempfile.mkdtemp(dir=out_dir, prefix=".download-")
  try:
    for name in args.datasets:
      if os.path.exists(os.path.join(out_dir, f"{name}.parquet")) and not args.force:
        print(f"[prepare_data] {name}: already in {out_dir} (--force replaces it)")
        continue
      try:
        print(f"[prepare_data] {prepare(name, out_dir, scratch)}", flush=True)
      except (OSError, ValueError) as e:  # network, hub, or data errors: one line each
        failed.append(name)
        print(f"prepare_data: {name}: {cli.one_line(e)}", file=sys.stderr)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  if failed:
    print(f"prepare_data: failed: {', '.join(failed)}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
