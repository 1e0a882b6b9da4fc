"""Replay-side steps of a training step: choose replayed questions and trajectories.

SPEC section 2, steps 1-3: after the delayed start, n_exp = min(floor(rho * B),
|candidates|) questions come from the buffer (Gaussian over buckets); for each, every
stored correct trajectory is scored under the CURRENT policy (mean full-vocabulary
entropy over its tokens, EOS included, temperature 1) in fixed-shape batches, and the
configured rule picks one.
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
  current_logp: np.ndarray      # under the current policy (for the no-IS ablation)
  num_candidates: int


def num_replayed(batch_questions: int, rho: float, num_candidates: int) -> int:
  return min(int(np.floor(rho * batch_questions)), num_candidates)


def choose_replays(buffer, question_ids, prompt_ids_of, *, cfg, params, rule: str,
                   max_new_tokens: int, batch_size: int, pad_id: int, chunk: int,
                   rng: np.random.Generator) -> list[Replay]:
  """Scores every candidate of each question and picks one per question by `rule`."""
  rows, owners = [], []
  for qi, qid in enumerate(question_ids):
    for traj in buffer.candidates(int(qid)):
      rows.append((prompt_ids_of(int(qid)), np.asarray(traj.token_ids)[:max_new_tokens],
                   np.asarray(traj.logps)[:max_new_tokens]))
      owners.append(qi)
  if not rows:
    return []
  logp_NxR, entropy_NxR, mask_NxR = score_rows(rows, cfg=cfg, params=params,
                                               max_new_tokens=max_new_tokens,
                                               batch_size=batch_size, pad_id=pad_id,
                                               chunk=chunk)
  owners = np.asarray(owners)
  choose = selection.SELECTIONS.get(rule)
  replays = []
  for qi, qid in enumerate(question_ids):
    idx = np.flatnonzero(owners == qi)
    best = idx[choose(entropy_NxR[idx], mask_NxR[idx], rng=rng)]
    n = int(mask_NxR[best].sum())
    replays.append(Replay(int(qid), rows[best][1], rows[best][2], logp_NxR[best, :n],
                          len(idx)))
  return replays


def score_rows(rows, *, cfg, params, max_new_tokens, batch_size, pad_id, chunk):
  """Log-probs, entropies and masks [N, R] of (prompt, response) rows, in batches."""
  prompt_len = padding.prompt_bucket(max(len(p) for p, _, _ in rows))
  logps, ents, masks = [], [], []
  for start in range(0, len(rows), batch_size):
    chunk_rows = rows[start:start + batch_size]
    chunk_rows += [chunk_rows[-1]] * (batch_size - len(chunk_rows))  # fixed shape
    tokens, valid, mask = padding.pack([p for p, _, _ in chunk_rows],
                                       [r for _, r, _ in chunk_rows], prompt_len,
                                       max_new_tokens, pad_id)
    logp, ent = learner.score_responses(cfg, params, tokens, valid, prompt_len, chunk)
    logps.append(np.asarray(logp))
    ents.append(np.asarray(ent))
    masks.append(mask)
  n = len(rows)
  return (np.concatenate(logps)[:n], np.concatenate(ents)[:n], np.concatenate(masks)[:n])
