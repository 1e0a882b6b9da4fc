"""The learner's prompt budget P, bucketed.

Rows hold `P + R` tokens (`packing`): P is the longest prompt of the batch rounded up
as the sampler rounds its prompts (`decode.length_bucket`: a multiple of 1/8 of the
next power of two, at least `train.prompt_bucket`), so a run compiles the learner a
handful of times and a row spends less than 1/4 of its prompt budget on padding; R is
the fixed max response length.
"""

from exgrpo_jax.sampling import decode

# The default of `train.prompt_bucket`. Short prompts (SmolLM2's 45-token arithmetic
# prompts: P = 48, not 64) then cost the learner a seventh less per row than under a
# bucket of 64 (docs/results/bench_train_learner_cpu.json).
PROMPT_BUCKET = 16


def prompt_bucket(max_prompt_len: int, minimum: int = PROMPT_BUCKET) -> int:
  return decode.length_bucket(max_prompt_len, minimum)
