"""Replay-side steps of a training step: choose replayed questions and trajectories.

docs/algorithm.md §4-§5 (n_exp itself is `phase.num_replayed`, §3): for each question
sampled from the buffer (Gaussian over buckets), every stored correct trajectory is
scored under the CURRENT policy (mean full-vocabulary entropy over its tokens, EOS
included, temperature 1), and the configured rule picks one. A question with a single
candidate needs no scoring (unless the no-IS ablation wants its current log-probs), the
scored trajectories are packed into rows, and the scoring batches shrink to the next
power of two of the rows left, so replay costs a forward pass only where there is a
choice to make, and only on real tokens.
"""

import dataclasses

import numpy as np

from exgrpo_jax.replay import selection
from exgrpo_jax.training import learner
from exgrpo_jax.training import packing
from exgrpo_jax.training import padding


@dataclasses.dataclass
class Scores:
  """`score_rows`' per-sequence results [S, R], zero after each response."""

  logp_SxR: np.ndarray     # float32, temperature 1
  entropy_SxR: np.ndarray  # float32, temperature 1
  mask_SxR: np.ndarray     # bool: the response's tokens
  rollout_logp_SxR: np.ndarray | None = None  # float32, at the rollout temperature


@dataclasses.dataclass
class Replay:
  """A replayed question with its chosen trajectory."""

  question_id: int
  tokens: np.ndarray            # response ids, EOS included
  behaviour_logp: np.ndarray    # recorded at collection
  current_logp: np.ndarray | None  # under the current policy (None: not scored)
  num_candidates: int


def choose_replays(buffer, question_ids, prompt_ids_of, *, cfg, params, rule: str,
                   max_new_tokens: int, batch_size: int, pad_id: int, chunk: int,
                   rng: np.random.Generator, need_current_logp: bool = False,
                   pack: bool = True, rollout_temperature: float | None = None,
                   prompt_bucket: int = padding.PROMPT_BUCKET) -> list[Replay]:
  """Scores the candidates of each question and picks one per question by `rule`.

  `need_current_logp` scores every chosen trajectory (the no-IS ablation uses its
  current log-probs); otherwise single-candidate questions skip the forward pass.
  `pack` packs the scored sequences into rows, and `rollout_temperature` is passed on
  so this scoring runs the same compiled program as the old log-probs' (`score_rows`).
  """
  rows, owners, counts = [], [], []
  for qi, qid in enumerate(question_ids):
    candidates = buffer.candidates(int(qid))
    counts.append(len(candidates))
    for traj in candidates:
      rows.append((prompt_ids_of(int(qid)), np.asarray(traj.token_ids)[:max_new_tokens],
                   np.asarray(traj.logps)[:max_new_tokens]))
      owners.append(qi)
  owners = np.asarray(owners)
  scored = [i for i, qi in enumerate(owners) if counts[qi] > 1 or need_current_logp]
  if scored:
    scores = score_rows(
        [rows[i] for i in scored], cfg=cfg, params=params, max_new_tokens=max_new_tokens,
        batch_size=batch_size, pad_id=pad_id, chunk=chunk, pack=pack,
        rollout_temperature=rollout_temperature, prompt_bucket=prompt_bucket)
  position = {row: j for j, row in enumerate(scored)}
  choose = selection.SELECTIONS.get(rule)
  replays = []
  for qi, qid in enumerate(question_ids):
    idx = np.flatnonzero(owners == qi)
    if idx[0] not in position:  # one candidate, nothing to choose or score
      best, current = idx[0], None
    else:
      j = np.array([position[i] for i in idx])
      pick = choose(scores.entropy_SxR[j], scores.mask_SxR[j], rng=rng)
      best = idx[pick]
      current = scores.logp_SxR[j[pick], :int(scores.mask_SxR[j[pick]].sum())]
    replays.append(Replay(int(qid), rows[best][1], rows[best][2], current, len(idx)))
  return replays


def _batch_size_for(remaining: int, batch_size: int) -> int:
  """The next power of two >= remaining, capped at batch_size (few compiled shapes)."""
  return min(batch_size, 1 << max(remaining - 1, 0).bit_length())


def call_sizes(num_rows: int, batch_size: int) -> list[int]:
  """The rows of each scoring call over `num_rows` packed rows (`score_rows`)."""
  sizes = []
  while num_rows > 0:
    sizes.append(_batch_size_for(num_rows, batch_size))
    num_rows -= sizes[-1]
  return sizes


def score_rows(rows, *, cfg, params, max_new_tokens, batch_size, pad_id, chunk, pack=True,
               rollout_temperature: float | None = None,
               prompt_bucket: int = padding.PROMPT_BUCKET) -> Scores:
  """Log-probs, entropies and masks [S, R] of (prompt, response, _) rows, and with
  `rollout_temperature` their log-probs at it too, from the same forward pass.

  The sequences are packed (`packing`; one per row with pack=False) into rows scored
  `batch_size` at a time; the prompt budget is the longest prompt bucketed
  (`padding.prompt_bucket` at least `prompt_bucket`).
  """
  prompts, responses = [p for p, _, _ in rows], [r for _, r, _ in rows]
  layout = packing.place([len(p) for p in prompts], [len(r) for r in responses],
                         padding.prompt_bucket(max(map(len, prompts)), prompt_bucket),
                         max_new_tokens,
                         pack)
  # Room for the last batch, which rounds up to a power of two.
  packed = packing.rows(layout, prompts, responses, layout.num_rows + batch_size, pad_id)
  logps, ents, rollout_logps = [], [], []
  start = 0
  for size in call_sizes(layout.num_rows, batch_size):
    batch = slice(start, start + size)
    start += size
    logp, ent, rollout_logp = learner.score_responses(
        cfg, params, packed.tokens_NxT[batch], packed.segment_ids_NxT[batch],
        packed.index_NxR[batch], chunk, rollout_temperature)
    logps.append(np.asarray(logp))
    ents.append(np.asarray(ent))
    if rollout_logp is not None:
      rollout_logps.append(np.asarray(rollout_logp))
  per_sequence = lambda parts: packing.from_slots(layout, np.concatenate(parts))
  return Scores(per_sequence(logps), per_sequence(ents),
                np.arange(max_new_tokens) < layout.length_S[:, None],
                per_sequence(rollout_logps) if rollout_logps else None)
