"""The learner's prompt budget P, bucketed.

Rows hold `P + R` tokens (`packing`): P is the longest prompt of the batch rounded up
to a multiple of PROMPT_BUCKET, so a run compiles the learner a handful of times; R is
the fixed max response length.
"""

PROMPT_BUCKET = 64


def prompt_bucket(max_prompt_len: int) -> int:
  return max(PROMPT_BUCKET, -(-max_prompt_len // PROMPT_BUCKET) * PROMPT_BUCKET)
