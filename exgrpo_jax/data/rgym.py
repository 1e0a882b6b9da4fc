"""Tasks from `reasoning_gym` (the optional extra) as questions, scored by its verifiers.

  data.source = "reasoning_gym"; data.reasoning_gym.dataset = "basic_arithmetic"
  pip install "exgrpo_jax[reasoning_gym]"   # or: pip install reasoning-gym

`data.reasoning_gym` names one of reasoning_gym's procedural datasets, its keyword options
(JSON, e.g. '{"min_terms": 2}'), the seed and the two split sizes. Entries are generated
by index from one dataset instance: the `eval` split takes the first `eval_size` entries
and the `train` split the next ones whose question text is not in `eval`, so held-out
accuracy measures questions never trained on. Both splits are pure functions of the
settings (uid = index within the split).

Rewards are graded in worker processes from text alone, so a question's `ground_truth`
is JSON naming its entry, which the `reasoning_gym` reward (`exgrpo_jax.rewards.gym`)
regenerates and scores with the dataset's own verifier, on the last <answer>...</answer>
of the response: the format `instruction` asks for.
"""

import dataclasses
import json

from exgrpo_jax.data import questions as questions_lib
from exgrpo_jax.rewards import gym

SPLITS = ("train", "eval")
REWARD = "reasoning_gym"


@dataclasses.dataclass(frozen=True)
class GymSettings:
  """Which reasoning_gym dataset and how many questions (config `data.reasoning_gym`).

  Attributes:
    dataset: a name in `reasoning_gym.factory.DATASETS` (e.g. "basic_arithmetic").
    options: JSON object of the dataset's config keywords ("{}" = its defaults).
    seed: the dataset's seed; the same settings always give the same questions.
    train_size: questions in the training split.
    eval_size: questions in the held-out split.
    instruction: appended to every question (reasoning_gym's answer-tag format).
  """

  dataset: str = ""
  options: str = "{}"
  seed: int = 0
  train_size: int = 200
  eval_size: int = 60
  instruction: str = ("Think step by step, then give only the final answer in the "
                      "format <answer>answer here</answer>.")


def make_questions(settings: GymSettings, split: str,
                   limit: int = 0) -> list[questions_lib.Question]:
  """The questions of one split ("train" or "eval"); `limit` keeps the first N."""
  if split not in SPLITS:
    raise ValueError(f"reasoning_gym split {split!r}: use one of {', '.join(SPLITS)}")
  if settings.train_size < 1 or settings.eval_size < 1:
    raise ValueError(f"reasoning_gym train_size={settings.train_size}, eval_size="
                     f"{settings.eval_size}: both must be positive")
  # Room for repeats of held-out questions, which the train split skips.
  size = 2 * (settings.train_size + settings.eval_size)
  dataset = gym.dataset(settings.dataset, settings.options, settings.seed, size)
  wanted = settings.train_size if split == "train" else settings.eval_size
  wanted = min(limit, wanted) if limit else wanted
  entries = [(i, dataset[i]) for i in range(settings.eval_size if split == "train" else wanted)]
  if split == "train":
    held_out, entries = {entry["question"] for _, entry in entries}, []
    for i in range(settings.eval_size, size):
      entry = dataset[i]
      if entry["question"] not in held_out:
        entries.append((i, entry))
        if len(entries) == wanted:
          break
    if len(entries) < wanted:
      raise ValueError(f"reasoning_gym {settings.dataset!r}: only {len(entries)} train "
                       f"questions outside the held-out split among {size} entries; ask "
                       "for fewer questions or change the options")
  options = json.loads(settings.options)
  questions = []
  for uid, (index, entry) in enumerate(entries):
    truth = gym.ground_truth(str(entry["answer"]), settings.dataset, options, settings.seed,
                             size, index)
    questions.append(questions_lib.Question(
        uid, ({"role": "user", "content": f"{entry['question']}\n\n{settings.instruction}"},),
        truth, f"reasoning_gym:{settings.dataset}", REWARD, {"split": split, "index": index}))
  return questions
