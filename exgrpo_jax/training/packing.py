"""Packing responses into rows of a fixed token budget for the learner and for scoring.

A row holds T = P + R tokens: whole sequences (prompt + response) back to back, each a
segment (segment ids 1, 2, ... in the row, 0 on padding; the model restarts RoPE
positions per segment and attends within it). Besides T tokens, a row holds at most R
response tokens, the R "slots" whose log-probs the learner computes, so a packed row costs
what a padded one does while holding several responses. With `pack=False` every
sequence gets a row of its own (the padded layout). Sequences are placed first-fit by
decreasing length; P is bucketed (`padding.prompt_bucket`) and R is fixed, so the
learner compiles once per prompt bucket.

A mini-batch's objective (docs/algorithm.md §11) is a weighted sum over its response
tokens: the policy loss's aggregation and the entropy bonus's token mean both have
denominators that belong to the whole mini-batch, not to the micro-batch a token lands
in. `token_weights` gives each token its weight in that sum, so micro-batch losses add
up to the mini-batch objective (and their gradients to its gradient) exactly.
"""

import dataclasses

import numpy as np

from exgrpo_jax import losses
from exgrpo_jax.training import learner


@dataclasses.dataclass
class Sequence:
  """One (prompt, response) sequence and, for the learner, its loss inputs."""

  prompt: np.ndarray                  # prompt ids
  tokens: np.ndarray                  # response ids, EOS included
  old_logp: np.ndarray | None = None  # per response token
  advantage: float = 0.0
  is_replay: bool = False
  rollout_log_ratio: np.ndarray | None = None  # per response token (fresh, recomputed)


@dataclasses.dataclass
class Layout:
  """Where S sequences sit in rows of `prompt_len + response_len` tokens.

  Sequence s keeps the last `prompt_len` prompt tokens and the first `response_len`
  response tokens; its `length_S[s]` response tokens start at `column_S[s]` of row
  `row_S[s]` and fill that row's scored slots from `slot_S[s]` on.
  """

  row_S: np.ndarray
  column_S: np.ndarray
  slot_S: np.ndarray
  length_S: np.ndarray
  num_rows: int
  prompt_len: int
  response_len: int


@dataclasses.dataclass
class Rows:
  """The model's input for `num` rows of a layout (padding rows are empty)."""

  tokens_NxT: np.ndarray       # int32
  segment_ids_NxT: np.ndarray  # int32, 0 on padding
  index_NxR: np.ndarray        # int32: the column whose hidden state scores each slot
  mask_NxR: np.ndarray         # bool: slots holding a response token


def place(prompt_lens, response_lens, prompt_len: int, response_len: int,
          pack: bool = True) -> Layout:
  """First-fit-decreasing placement of sequences (lengths before truncation)."""
  p_S = np.minimum(np.asarray(prompt_lens, np.int64), prompt_len)
  r_S = np.minimum(np.asarray(response_lens, np.int64), response_len)
  n = len(p_S)
  if n and p_S.min() < 1:  # its first response token would have no position to score it
    raise ValueError(f"sequence {int(np.argmin(p_S))} has an empty prompt")
  row_S, column_S, slot_S = (np.zeros(n, np.int64) for _ in range(3))
  free_tokens = np.full(n, prompt_len + response_len)
  free_slots = np.full(n, response_len)
  num_rows = 0
  for s in np.argsort(-(p_S + r_S), kind="stable"):
    fits = (free_tokens[:num_rows] >= p_S[s] + r_S[s]) & (free_slots[:num_rows] >= r_S[s])
    row = int(np.argmax(fits)) if pack and fits.any() else num_rows
    num_rows = max(num_rows, row + 1)
    used = prompt_len + response_len - free_tokens[row]
    row_S[s], column_S[s], slot_S[s] = row, used + p_S[s], response_len - free_slots[row]
    free_tokens[row] -= p_S[s] + r_S[s]
    free_slots[row] -= r_S[s]
  return Layout(row_S, column_S, slot_S, r_S, num_rows, prompt_len, response_len)


def rows(layout: Layout, prompts, responses, num: int, pad_id: int) -> Rows:
  """Token rows of the layout, `num` (>= layout.num_rows) of them."""
  P, R = layout.prompt_len, layout.response_len
  tokens = np.full((num, P + R), pad_id, np.int32)
  segments = np.zeros((num, P + R), np.int32)
  index = np.zeros((num, R), np.int32)
  mask = np.zeros((num, R), bool)
  for s, (prompt, response) in enumerate(zip(prompts, responses)):
    row, column, slot, n = (layout.row_S[s], layout.column_S[s], layout.slot_S[s],
                            layout.length_S[s])
    prompt = np.asarray(prompt)[-P:]
    start = column - len(prompt)
    tokens[row, start:column] = prompt
    tokens[row, column:column + n] = np.asarray(response)[:n]
    segments[row, start:column + n] = segments[row].max() + 1
    # The hidden state before a token predicts it.
    index[row, slot:slot + n] = np.arange(column - 1, column + n - 1)
    mask[row, slot:slot + n] = True
  return Rows(tokens, segments, index, mask)


def to_slots(layout: Layout, per_sequence, num: int, dtype, fill=0) -> np.ndarray:
  """[num, R] slot values from one value per sequence, or one per response token."""
  out = np.full((num, layout.response_len), fill, dtype)
  for s, value in enumerate(per_sequence):
    row, slot, n = layout.row_S[s], layout.slot_S[s], layout.length_S[s]
    out[row, slot:slot + n] = value if np.ndim(value) == 0 else np.asarray(value)[:n]
  return out


def from_slots(layout: Layout, values_NxR: np.ndarray) -> np.ndarray:
  """[S, R] per-sequence response values (zero after each response) from slot values."""
  out = np.zeros((len(layout.row_S), layout.response_len), values_NxR.dtype)
  for s, (row, slot, n) in enumerate(zip(layout.row_S, layout.slot_S, layout.length_S)):
    out[s, :n] = values_NxR[row, slot:slot + n]
  return out


def token_weights(mask_SxR, aggregation: str, norm_len: float) -> np.ndarray:
  """Per-token weights w of `aggregation` over S sequences (one per row, loss tokens in
  `mask_SxR`): `losses.aggregate(l, mask, aggregation, norm_len) == sum(w * l)`."""
  mask_SxR = np.asarray(mask_SxR, np.float32)
  if aggregation == "token_sum_norm":
    return mask_SxR / np.float32(norm_len)
  if aggregation == "token_mean":
    return mask_SxR / max(mask_SxR.sum(), 1)
  if aggregation == "seq_mean_token_mean":
    tokens_Sx1 = mask_SxR.sum(axis=1, keepdims=True)
    return mask_SxR / np.maximum(tokens_Sx1, 1) / max((tokens_Sx1 > 0).sum(), 1)
  raise ValueError(f"unknown loss aggregation {aggregation!r}; known: {losses.AGGREGATIONS}")


def policy_shares(lengths_S, parts, aggregation: str, norm_len: float) -> np.ndarray:
  """Per part (mini-batch) of S sequences: what its policy loss is multiplied by to be
  its share of the policy loss of all S at once. A token's weight in the whole and in
  its part differ by one factor per part for every aggregation: 1 for token_sum_norm,
  the part's share of the tokens for token_mean, of the sequences for
  seq_mean_token_mean."""
  lengths_S = np.asarray(lengths_S)
  mask_SxL = np.arange(max(int(lengths_S.max()), 1)) < lengths_S[:, None]
  whole_SxL = token_weights(mask_SxL, aggregation, norm_len)
  shares = []
  for part in parts:
    own = token_weights(mask_SxL[part], aggregation, norm_len).sum()
    shares.append(whole_SxL[part].sum() / own if own else 0.0)
  return np.array(shares)


def train_batch(responses: list[Sequence], *, prompt_len: int, response_len: int,
                micro_batch: int, num_micro: int, pad_id: int, aggregation: str,
                norm_len: float, pack: bool = True,
                rollout_log_ratio: bool = False) -> learner.TrainBatch:
  """One mini-batch as `num_micro` micro-batches of `micro_batch` rows.

  `num_micro * micro_batch` rows must hold the layout (one response per row always
  fits); micro-batches past the last used row are empty and the learner skips them.
  `rollout_log_ratio` carries the sequences' `rollout_log_ratio` (0 where None).
  """
  layout = place([len(r.prompt) for r in responses], [len(r.tokens) for r in responses],
                 prompt_len, response_len, pack)
  num = num_micro * micro_batch
  if layout.num_rows > num:
    raise ValueError(f"{len(responses)} responses need {layout.num_rows} rows; the "
                     f"mini-batch has {num_micro} x {micro_batch}")
  r = rows(layout, [x.prompt for x in responses], [x.tokens for x in responses], num, pad_id)
  lengths_S = layout.length_S
  weights_SxR = token_weights(np.arange(response_len) < lengths_S[:, None], aggregation,
                              norm_len)
  slots = lambda values, dtype: to_slots(layout, values, num, dtype)
  arrays = dict(
      tokens_MxBxT=r.tokens_NxT, segment_ids_MxBxT=r.segment_ids_NxT,
      index_MxBxR=r.index_NxR, mask_MxBxR=r.mask_NxR,
      old_logp_MxBxR=slots([x.old_logp for x in responses], np.float32),
      adv_MxBxR=slots([x.advantage for x in responses], np.float32),
      is_replay_MxBxR=slots([x.is_replay for x in responses], bool),
      weight_MxBxR=slots(list(weights_SxR), np.float32))
  if rollout_log_ratio:
    arrays["rollout_log_ratio_MxBxR"] = slots(
        [0.0 if x.rollout_log_ratio is None else x.rollout_log_ratio for x in responses],
        np.float32)
  return learner.TrainBatch(**{
      name: a.reshape((num_micro, micro_batch) + a.shape[1:]) for name, a in arrays.items()})
