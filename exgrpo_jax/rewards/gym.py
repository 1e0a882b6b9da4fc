"""reasoning_gym's verifiers as a reward: regenerate the entry a ground truth names, score.

The `reasoning_gym` reward (registered in `graders.py`) grades from text alone, as every
reward does in the pool's worker processes: a question's ground truth is JSON naming its
entry (the answer first, for logs; then dataset, options, seed, size, index), which
`exgrpo_jax.data.rgym` writes. `score` regenerates that entry (cached per process) and
returns the dataset's own `score_answer(answer, entry)` (some datasets give partial credit
in [0, 1]) for the last <answer>...</answer> of the response; a response without one has no
answer. `dataset` is also how `data.rgym` builds its questions, so both sides see the same
entries.
"""

import functools
import json

INSTALL = "pip install 'exgrpo_jax[reasoning_gym]' (or pip install reasoning-gym)"


def load_gym():
  """The `reasoning_gym` package (an optional extra), or ValueError naming the install."""
  try:
    import reasoning_gym  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError(f"reasoning_gym is not installed: {INSTALL}") from None
  return reasoning_gym


@functools.lru_cache(maxsize=16)
def dataset(name: str, options: str, seed: int, size: int):
  """One dataset instance (cached: workers score many entries of the same one)."""
  gym = load_gym()
  if name not in gym.factory.DATASETS:
    raise ValueError(f"reasoning_gym dataset {name!r} is unknown; known: "
                     f"{', '.join(sorted(gym.factory.DATASETS))}")
  try:
    kwargs = json.loads(options)
  except json.JSONDecodeError as e:
    raise ValueError(f"reasoning_gym options {options!r}: not JSON ({e})") from None
  if not isinstance(kwargs, dict):
    raise ValueError(f"reasoning_gym options {options!r}: must be a JSON object")
  try:
    return gym.create_dataset(name, **kwargs, seed=seed, size=size)
  except (TypeError, ValueError, AssertionError) as e:
    raise ValueError(f"reasoning_gym dataset {name!r} with options {options}: "
                     f"{str(e) or type(e).__name__}") from None


def ground_truth(answer: str, name: str, options: dict, seed: int, size: int,
                 index: int) -> str:
  """The ground-truth text naming one entry (what `score` reads back)."""
  return json.dumps(dict(answer=answer, dataset=name, options=options, seed=seed, size=size,
                         index=index))


def score(solution: str, truth: str) -> float | None:
  """The dataset's own score of the last <answer> in `solution`; None without one."""
  answer = load_gym().utils.extract_answer(solution)
  if answer is None:
    return None
  data, entry = _reference(truth)
  return float(data.score_answer(answer, entry))


@functools.lru_cache(maxsize=4096)
def _reference(truth: str):
  """(dataset, entry) named by a ground truth (cached: K responses share one)."""
  ref = json.loads(truth)
  data = dataset(ref["dataset"], json.dumps(ref["options"]), ref["seed"], ref["size"])
  return data, data[ref["index"]]
