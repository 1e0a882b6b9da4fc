"""Where a run's questions come from: data sources by name (`data.source`, `eval.source`).

  train = sources.load(config, "train")   # LoadResult: questions and skipped-row messages
  held_out = sources.load(config, "eval")

  file        `data.train_path` / `eval.path` (parquet or JSONL, `data.questions`)
  arithmetic  generated integer arithmetic (`data.arithmetic`), no files; the eval split
              is held out from training
  reasoning_gym  a `reasoning_gym` dataset (`data.reasoning_gym`, the optional extra),
              scored by its own verifier; the eval split is held out from training

A source is a function (config, split) -> LoadResult; register more with
`@SOURCES.register(name)`. `data.limit` / `eval.limit` keep the first N questions
(`eval.subset="spread"`: N spread evenly over the held-out questions, `spread`).
"""

import dataclasses

from exgrpo_jax import registry
from exgrpo_jax.data import arithmetic
from exgrpo_jax.data import questions as questions_lib
from exgrpo_jax.data import rgym

SOURCES = registry.Registry("data source")
SPLITS = ("train", "eval")
SUBSETS = ("first", "spread")  # eval.subset


def source_name(config, split: str) -> str:
  """The source configured for `split` ("train": data.source, "eval": eval.source)."""
  if split not in SPLITS:
    raise ValueError(f"split {split!r}: use one of {', '.join(SPLITS)}")
  return config.data.source if split == "train" else config.eval.source


def load(config, split: str) -> questions_lib.LoadResult:
  """The questions of `split` from its configured source (`eval.subset` "spread": the
  `eval.limit` held-out questions spread evenly over all of them)."""
  source = SOURCES.get(source_name(config, split))
  if split == "train" or config.eval.subset == "first" or not config.eval.limit:
    return source(config, split)
  whole = config.copy_and_resolve_references()
  whole.eval.limit = 0
  loaded = source(whole, split)
  return dataclasses.replace(loaded, questions=spread(loaded.questions, config.eval.limit))


def spread(items: list, n: int) -> list:
  """`n` of `items` at even intervals from the first (all of them if `n` is not fewer):
  a file grouped by benchmark keeps each benchmark's share, give or take one."""
  if n >= len(items):
    return list(items)
  return [items[len(items) * i // n] for i in range(n)]


def has_eval_data(config) -> bool:
  """Whether the config names held-out questions (a file source needs `eval.path`)."""
  return config.eval.source != "file" or bool(config.eval.path)


@SOURCES.register("file")
def from_file(config, split: str) -> questions_lib.LoadResult:
  path, limit = ((config.data.train_path, config.data.limit) if split == "train"
                 else (config.eval.path, config.eval.limit))
  return questions_lib.load_questions(path, skip_bad_rows=config.data.skip_bad_rows,
                                      limit=limit, reward_name=config.reward.name,
                                      data_dir=config.data.dir)


def arithmetic_settings(config) -> arithmetic.ArithmeticSettings:
  return arithmetic.ArithmeticSettings(**config.data.arithmetic.to_dict())


@SOURCES.register("arithmetic")
def from_arithmetic(config, split: str) -> questions_lib.LoadResult:
  settings = arithmetic_settings(config)
  limit = config.data.limit if split == "train" else config.eval.limit
  questions = arithmetic.make_questions(settings, split, limit)
  if config.reward.name:
    questions = [dataclasses.replace(q, reward_name=config.reward.name) for q in questions]
  return questions_lib.LoadResult(f"arithmetic:{split}", questions, [])


@SOURCES.register("reasoning_gym")
def from_reasoning_gym(config, split: str) -> questions_lib.LoadResult:
  settings = rgym.GymSettings(**config.data.reasoning_gym.to_dict())
  limit = config.data.limit if split == "train" else config.eval.limit
  return questions_lib.LoadResult(f"reasoning_gym:{settings.dataset}:{split}",
                                  rgym.make_questions(settings, split, limit), [])
