"""Host-side finishing of sampled rows: stop strings, masks, texts -> `RolloutOutput`.

Both engines hand their raw rows (token ids, per-token log-probs, how many tokens each
row emitted and whether it ended on EOS) to `finalize`, so stop strings, masks and texts
mean the same thing whichever engine generated them.

Stop strings are matched on the decoded text (special tokens skipped), as vLLM does: a
row ends with the token that completes the earliest-ending occurrence of any stop
string; that token stays in the mask, everything after it becomes padding, and the text
ends right after the stop string. The JAX engine checks them here, after generation (a
row may have decoded past its stop string; those tokens are discarded); its continuous
scheduler also checks them between decode chunks, to free the row's slot early.
"""

from typing import Sequence

import numpy as np

from exgrpo_jax.sampling import base


def _stop_end(text: str, stop_strings: Sequence[str]) -> int | None:
  """The end offset of the earliest-ending stop-string occurrence in `text`, or None."""
  ends = [text.find(s) + len(s) for s in stop_strings if s in text]
  return min(ends) if ends else None


def _decode(tokenizer, ids) -> str:
  return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def has_stop_string(tokenizer, ids, stop_strings: Sequence[str]) -> bool:
  """Whether the decoded text of `ids` contains any of `stop_strings`."""
  return _stop_end(_decode(tokenizer, ids), stop_strings) is not None


def stop_at_strings(tokenizer, ids: np.ndarray, stop_strings: Sequence[str]):
  """(number of tokens to keep, text) if a stop string occurs in `ids`' text, else None.

  The kept prefix is the shortest one whose decoded text contains a stop string
  (binary search over prefix lengths: text only grows as tokens are appended).
  """
  if not stop_strings or not has_stop_string(tokenizer, ids, stop_strings):
    return None
  lo, hi = 0, len(ids)  # the prefix of length hi contains a stop string, lo does not
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if _stop_end(_decode(tokenizer, ids[:mid]), stop_strings) is None:
      lo = mid
    else:
      hi = mid
  text = _decode(tokenizer, ids[:hi])
  return hi, text[:_stop_end(text, stop_strings)]


def finalize(tokens_NxT: np.ndarray, logprobs_NxT: np.ndarray, entropy_NxT: np.ndarray | None,
             lengths_N: np.ndarray, eos_N: np.ndarray, prompt_index_N: np.ndarray, tokenizer,
             stop_strings: Sequence[str], pad_id: int) -> base.RolloutOutput:
  """Applies stop strings, builds masks and texts; inputs are host numpy arrays.

  Args:
    tokens_NxT: sampled ids; entries at or beyond a row's length are ignored.
    logprobs_NxT, entropy_NxT: per-token values (entropy may be None).
    lengths_N: tokens emitted per row (EOS included).
    eos_N: whether the row ended on an EOS id.
    prompt_index_N: the prompt of each row.
    tokenizer: HF tokenizer for texts and stop strings; None gives empty texts (and then
      `stop_strings` must be empty).
    stop_strings: see `SamplingConfig.stop_strings`.
    pad_id: written after each row's end.
  """
  if tokenizer is None and stop_strings:
    raise ValueError("stop_strings need a tokenizer to decode the responses")
  tokens_NxT = np.array(tokens_NxT, np.int32)
  lengths_N = np.array(lengths_N, np.int32)
  stopped_N = np.zeros(len(lengths_N), bool)
  texts = []
  for i, length in enumerate(lengths_N):
    if tokenizer is None:
      texts.append("")
      continue
    cut = stop_at_strings(tokenizer, tokens_NxT[i, :length], stop_strings)
    if cut is None:
      texts.append(_decode(tokenizer, tokens_NxT[i, :length]))
    else:
      lengths_N[i], text = cut
      stopped_N[i] = True
      texts.append(text)
  T = tokens_NxT.shape[1]
  mask_NxT = np.arange(T)[None, :] < lengths_N[:, None]
  tokens_NxT[~mask_NxT] = pad_id
  logprobs_NxT = np.where(mask_NxT, logprobs_NxT, 0.0).astype(np.float32)
  if entropy_NxT is not None:
    entropy_NxT = np.where(mask_NxT, entropy_NxT, 0.0).astype(np.float32)
  eos_N = np.asarray(eos_N, bool) & ~stopped_N
  truncated_N = (lengths_N >= T) & ~eos_N & ~stopped_N
  return base.RolloutOutput(
      tokens_NxT=tokens_NxT, mask_NxT=mask_NxT, logprobs_NxT=logprobs_NxT,
      entropy_NxT=entropy_NxT, lengths_N=lengths_N, truncated_N=truncated_N, texts=texts,
      prompt_index_N=np.asarray(prompt_index_N, np.int32))


def empty(max_new_tokens: int, return_entropy: bool) -> base.RolloutOutput:
  """The output for a call that asked for no samples at all."""
  z = np.zeros((0, max_new_tokens))
  return base.RolloutOutput(
      tokens_NxT=z.astype(np.int32), mask_NxT=z.astype(bool), logprobs_NxT=z.astype(np.float32),
      entropy_NxT=z.astype(np.float32) if return_entropy else None,
      lengths_N=np.zeros(0, np.int32), truncated_N=np.zeros(0, bool), texts=[],
      prompt_index_N=np.zeros(0, np.int32))
