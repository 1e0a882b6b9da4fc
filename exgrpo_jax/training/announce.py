"""One line before each long silent phase of a run: compiling, evaluating.

  notices = announce.Notices()          # before anything compiles: reads the cache state
  notices.compiling("step 1", "the rollout, scoring and train-step programs")
  notices.evaluating(step, num_problems, samples, jax_sampler=True)

A compile is said once per kind of program and process. Whether it is a first compile
is judged from JAX's persistent compilation cache (`exgrpo_jax.compile_cache`) as it
was when the run started: empty (or off), the programs are compiled now; with entries
from earlier runs, they may instead be loaded from it, and the line says so rather
than promise a long compile. Only process 0 prints.
"""

import os
import sys

import jax


def _cache_note() -> str:
  """What follows "compiling X" given the compile cache's state now."""
  directory = jax.config.jax_compilation_cache_dir
  if not directory:
    return " (compile cache off: every run compiles them)"
  if not os.path.isdir(directory) or not os.listdir(directory):
    return f" (first run; cached for the next in {directory})"
  return f", or loading them from the compile cache {directory} (an earlier run's)"


class Notices:
  """The run's progress notes on stderr (process 0)."""

  def __init__(self):
    self._cache = _cache_note()
    self._said = set()

  def say(self, line: str) -> None:
    if jax.process_index() == 0:
      print(f"[exgrpo_jax] {line}", file=sys.stderr, flush=True)

  def compiling(self, when: str, what: str) -> None:
    """`what` is about to compile for the first time in this process."""
    if what not in self._said:
      self._said.add(what)
      self.say(f"{when}: compiling {what}{self._cache}")

  def evaluating(self, step: int, num_problems: int, samples: int,
                 jax_sampler: bool = True) -> None:
    """An evaluation of `num_problems` (none: nothing to say) is about to start;
    `jax_sampler`: it runs on the JAX sampler, whose programs compile first (vLLM's
    start-up says its own)."""
    if not num_problems:
      return
    if jax_sampler:
      self.compiling(f"step {step}", "the sampler's programs")
    per = f", {samples} samples each" if samples > 1 else ""
    self.say(f"step {step}: evaluating on {num_problems} problems{per}")
