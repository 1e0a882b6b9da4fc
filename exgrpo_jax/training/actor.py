"""The learner bound once to a run: model config, loss and optimizer settings, lengths.

  actor = Actor(config, model_cfg, pad_id)
  replays = actor.choose_replays(params, buffer, prompts, rng)          # steps 2-3
  logp_N, rollout_t_logp_N = actor.score(params, [(prompt_ids, tokens), ...])  # pi_old
  params, opt_state, metrics = actor.update(params, opt_state, groups, use_clip, rng)

The jitted step itself is `learner.train_step` (compiled once per parameter sharding).
"""

import jax
import numpy as np

from exgrpo_jax.training import experience
from exgrpo_jax.training import learner
from exgrpo_jax.training import packing
from exgrpo_jax.training import padding
from exgrpo_jax.training import phase


class Actor:
  """Scores responses and takes the optimizer steps of a training step (docs/algorithm.md §12)."""

  def __init__(self, config, model_cfg, pad_id: int):
    self.model_cfg = model_cfg
    self.pad_id = pad_id
    self.algo = learner.frozen(config.algo)
    self.optim = learner.frozen(config.optim)
    self.lr = config.optim.lr
    self.mini_batches = config.optim.mini_batches
    self.micro_batch_size = config.optim.micro_batch_size
    self.max_new_tokens = config.rollout.max_new_tokens
    self.chunk = config.train.logprob_chunk
    self.trajectory_selection = config.algo.trajectory_selection
    self.pack = config.train.packing
    self.prompt_bucket = config.train.prompt_bucket
    self.rollout_temperature = phase.rollout_logp_temperature(config.rollout)
    self.measures_mismatch = phase.recompute_old_logps(config)

  def choose_replays(self, params, buffer, prompts, rng) -> list[experience.Replay]:
    """The trajectory to replay for each of `prompts` (buffered questions), by rule."""
    by_uid = {p.question.uid: list(p.ids) for p in prompts}
    return experience.choose_replays(
        buffer, list(by_uid), by_uid.__getitem__, cfg=self.model_cfg, params=params,
        rule=self.trajectory_selection, max_new_tokens=self.max_new_tokens,
        batch_size=self.micro_batch_size, pad_id=self.pad_id, chunk=self.chunk, rng=rng,
        need_current_logp=not self.algo.is_correction, pack=self.pack,
        rollout_temperature=self.rollout_temperature, prompt_bucket=self.prompt_bucket)

  def score(self, params, rows) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Log-probs of each (prompt ids, response tokens) row's tokens at temperature 1,
    and at the rollout temperature (the same arrays when that is 1), in one pass."""
    scores = experience.score_rows(
        [(p, r, None) for p, r in rows], cfg=self.model_cfg, params=params,
        max_new_tokens=self.max_new_tokens, batch_size=self.micro_batch_size,
        pad_id=self.pad_id, chunk=self.chunk, pack=self.pack,
        rollout_temperature=self.rollout_temperature, prompt_bucket=self.prompt_bucket)
    lengths = scores.mask_SxR.sum(axis=1)
    logp = [lp[:n] for lp, n in zip(scores.logp_SxR, lengths)]
    if scores.rollout_logp_SxR is None:
      return logp, logp
    return logp, [lp[:n] for lp, n in zip(scores.rollout_logp_SxR, lengths)]

  def update(self, params, opt_state, groups, use_clip: bool, rng: np.random.Generator):
    """Splits the groups' B*K responses into mini-batches, one optimizer step each.

    Each mini-batch is packed into rows (`train.packing`; `packing.train_batch`).
    Returns (params, opt_state, the step's metrics: `learner.combine_step_metrics`).
    """
    responses = [packing.Sequence(g.prompt_ids, r.tokens, r.old_logp, adv, r.is_replay,
                                  r.rollout_log_ratio)
                 for g in groups for r, adv in zip(g.responses, g.advantages)]
    order = rng.permutation(len(responses))
    prompt_len = padding.prompt_bucket(max(len(r.prompt) for r in responses),
                                       self.prompt_bucket)
    micro = self.micro_batch_size
    per_mini = -(-len(responses) // self.mini_batches)
    metrics, parts = [], np.array_split(order, self.mini_batches)
    for part in parts:
      batch = packing.train_batch(
          [responses[i] for i in part], prompt_len=prompt_len,
          response_len=self.max_new_tokens, micro_batch=micro,
          num_micro=-(-per_mini // micro), pad_id=self.pad_id,
          aggregation=self.algo.aggregation, norm_len=self.algo.norm_len, pack=self.pack,
          rollout_log_ratio=self.measures_mismatch)
      params, opt_state, m = learner.train_step(
          params, opt_state, batch, cfg=self.model_cfg, algo=self.algo, optim=self.optim,
          use_clip=use_clip, chunk=self.chunk)
      metrics.append(m)
    # One device->host transfer per step, after both optimizer steps are queued.
    shares = packing.policy_shares(
        [min(len(r.tokens), self.max_new_tokens) for r in responses], parts,
        self.algo.aggregation, self.algo.norm_len)
    merged = learner.combine_step_metrics(jax.device_get(metrics), shares,
                                          self.algo.entropy_coeff)
    merged["lr"] = self.lr
    return params, opt_state, merged
