"""Packing prompts and responses into fixed-shape arrays for the learner.

A row is `prompt left-padded to P` + `response right-padded to R`; P is rounded up to a
bucket so a run compiles the learner a handful of times, R is the fixed max response
length. Padding rows (all invalid) fill micro-batches to their fixed size.
"""

import numpy as np

PROMPT_BUCKET = 64


def prompt_bucket(max_prompt_len: int) -> int:
  return max(PROMPT_BUCKET, -(-max_prompt_len // PROMPT_BUCKET) * PROMPT_BUCKET)


def pack(prompts, responses, prompt_len: int, response_len: int, pad_id: int):
  """Returns tokens [N, P+R] int32, valid [N, P+R] bool and response mask [N, R] bool."""
  n = len(prompts)
  tokens = np.full((n, prompt_len + response_len), pad_id, np.int32)
  valid = np.zeros(tokens.shape, bool)
  mask = np.zeros((n, response_len), bool)
  for i, (p, r) in enumerate(zip(prompts, responses)):
    p, r = np.asarray(p)[-prompt_len:], np.asarray(r)[:response_len]
    tokens[i, prompt_len - len(p):prompt_len] = p
    tokens[i, prompt_len:prompt_len + len(r)] = r
    valid[i, prompt_len - len(p):prompt_len + len(r)] = True
    mask[i, :len(r)] = True
  return tokens, valid, mask


def pad_rows(array: np.ndarray, rows: int, value=0) -> np.ndarray:
  """Appends `rows - len(array)` rows filled with `value`."""
  extra = rows - array.shape[0]
  if extra <= 0:
    return array
  fill = np.full((extra,) + array.shape[1:], value, array.dtype)
  return np.concatenate([array, fill])


def to_micro_batches(array: np.ndarray, micro: int) -> np.ndarray:
  """[N, ...] -> [M, micro, ...] (N must already be a multiple of micro)."""
  return array.reshape((array.shape[0] // micro, micro) + array.shape[1:])
