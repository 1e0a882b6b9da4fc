"""Replay-side steps of a training step: choose replayed questions and trajectories.

SPEC section 2, steps 2-3 (n_exp itself is `phase.num_replayed`): for each question
sampled from the buffer (Gaussian over buckets), every stored correct trajectory is
scored under the CURRENT policy (mean full-vocabulary entropy over its tokens, EOS
included, temperature 1), and the configured rule picks one. A question with a single
candidate needs no scoring (unless the no-IS ablation wants its current log-probs), and
the scoring batches shrink to the next power of two of the rows left, so replay costs a
forward pass only where there is a choice to make.
"""

import dataclasses

import numpy as np

from exgrpo_jax.replay import selection
from exgrpo_jax.training import learner
from exgrpo_jax.training import padding


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
                   rng: np.random.Generator, need_current_logp: bool = False
                   ) -> list[Replay]:
  """Scores the candidates of each question and picks one per question by `rule`.

  `need_current_logp` scores every chosen trajectory (the no-IS ablation uses its
  current log-probs); otherwise single-candidate questions skip the forward pass.
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
    logp_NxR, entropy_NxR, mask_NxR = score_rows(
        [rows[i] for i in scored], cfg=cfg, params=params, max_new_tokens=max_new_tokens,
        batch_size=batch_size, pad_id=pad_id, chunk=chunk)
  position = {row: j for j, row in enumerate(scored)}
  choose = selection.SELECTIONS.get(rule)
  replays = []
  for qi, qid in enumerate(question_ids):
    idx = np.flatnonzero(owners == qi)
    if idx[0] not in position:  # one candidate, nothing to choose or score
      best, current = idx[0], None
    else:
      j = np.array([position[i] for i in idx])
      pick = choose(entropy_NxR[j], mask_NxR[j], rng=rng)
      best = idx[pick]
      current = logp_NxR[j[pick], :int(mask_NxR[j[pick]].sum())]
    replays.append(Replay(int(qid), rows[best][1], rows[best][2], current, len(idx)))
  return replays


def _batch_size_for(remaining: int, batch_size: int) -> int:
  """The next power of two >= remaining, capped at batch_size (few compiled shapes)."""
  return min(batch_size, 1 << max(remaining - 1, 0).bit_length())


def score_rows(rows, *, cfg, params, max_new_tokens, batch_size, pad_id, chunk):
  """Log-probs, entropies and masks [N, R] of (prompt, response) rows, in batches."""
  prompt_len = padding.prompt_bucket(max(len(p) for p, _, _ in rows))
  logps, ents, masks = [], [], []
  start = 0
  while start < len(rows):
    size = _batch_size_for(len(rows) - start, batch_size)
    chunk_rows = rows[start:start + size]
    chunk_rows += [chunk_rows[-1]] * (size - len(chunk_rows))  # fixed shape
    start += size
    tokens, valid, mask = padding.pack([p for p, _, _ in chunk_rows],
                                       [r for _, r, _ in chunk_rows], prompt_len,
                                       max_new_tokens, pad_id)
    logp, ent = learner.score_responses(cfg, params, tokens, valid, prompt_len, chunk)
    logps.append(np.asarray(logp))
    ents.append(np.asarray(ent))
    masks.append(mask)
  n = len(rows)
  return (np.concatenate(logps)[:n], np.concatenate(ents)[:n], np.concatenate(masks)[:n])
