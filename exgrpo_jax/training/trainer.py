"""The ExGRPO training loop (SPEC section 2), one training step at a time.

  trainer = Trainer(config, workdir)      # resumes from <workdir>/checkpoints if present
  trainer.run()

Per step: compose the batch (fresh questions + Gaussian-sampled replays after the delayed
start), pick each replay's lowest-entropy trajectory under the current policy, roll out
K fresh samples (K-1 for replayed questions), verify rewards in worker processes, compute
group advantages, update the buffer (retire K/K, bucket and store 1..K-1), then take
`optim.mini_batches` jitted AdamW steps. Metrics go to JSONL/TensorBoard, checkpoints are
written every `train.checkpoint_every` steps and on SIGTERM, and the run evaluates on
`eval.path` every `eval.every` steps.
"""

import os
import signal
import time

import jax
import numpy as np

from exgrpo_jax import advantages
from exgrpo_jax import distributed
from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax.training import config_check
from exgrpo_jax.training import experience
from exgrpo_jax.training import learner
from exgrpo_jax.training import packing
from exgrpo_jax.training import padding
from exgrpo_jax.training import run_log
from exgrpo_jax.training import run_state


class Trainer:
  """Owns the run: model, optimizer, buffer, data stream, rollout engine, rewards."""

  def __init__(self, config, workdir: str, engine=None):
    config_check.check(config)
    self.config = config
    self.workdir = workdir
    self.state = run_state.RunState.create_or_restore(config, workdir)
    st = self.state
    # max_rows bounds the JAX sampler's KV cache (BUILD.md, "Memory plan").
    options = ({"max_rows": config.rollout.max_rows or None}
               if config.rollout.engine == "jax" else {})
    self.engine = engine or sampling.make_engine(config.rollout.engine, st.model_cfg,
                                                 st.tokenizer, **options)
    self.log = run_log.RunLog(workdir, config.train.steps, start_step=st.step)
    self._stop_requested = False
    self._algo = learner.frozen(config.algo)
    self._optim = learner.frozen(config.optim)

  # --- one training step --------------------------------------------------------------------

  def train_step(self) -> dict:
    cfg, st = self.config, self.state
    k, batch_q = cfg.rollout.k, cfg.train.batch_questions
    timings, t_step = {}, time.time()
    step = st.step + 1
    rng = np.random.default_rng([cfg.train.seed, step])

    # 1-3. Batch composition and trajectory selection.
    t = time.time()
    n_exp = 0
    if st.replay_started and cfg.algo.rho > 0:
      n_exp = experience.num_replayed(batch_q, cfg.algo.rho, st.buffer.num_candidates)
    replay_qids = st.buffer.sample_questions(n_exp) if n_exp else []
    replays = experience.choose_replays(
        st.buffer, replay_qids, st.prompt_ids, cfg=st.model_cfg, params=st.params,
        rule=cfg.algo.trajectory_selection, max_new_tokens=cfg.rollout.max_new_tokens,
        batch_size=cfg.optim.micro_batch_size, pad_id=st.pad_id,
        chunk=cfg.train.logprob_chunk, rng=rng,
        need_current_logp=not cfg.algo.is_correction, pack=cfg.train.packing)
    fresh_qids = [q.uid for q in st.stream.next_batch(batch_q - len(replays))]
    timings["select"] = time.time() - t

    # 4. Rollout: K fresh samples per fresh question, K-1 per replayed question.
    t = time.time()
    qids = list(fresh_qids) + [r.question_id for r in replays]
    counts = [k] * len(fresh_qids) + [k - 1] * len(replays)
    key = jax.random.fold_in(jax.random.key(cfg.train.seed), step)
    out = self.engine.generate([st.prompt_ids(q) for q in qids], counts, st.params, key,
                               st.sampling_config)
    timings["gen"] = time.time() - t

    # Groups: [Q][K] members (tokens, old log-probs, is_replay); a replay goes last.
    groups, texts = [], []
    row = 0
    for qi, q in enumerate(qids):
      members = []
      for _ in range(counts[qi]):
        n = int(out.lengths_N[row])
        members.append((out.tokens_NxT[row, :n], out.logprobs_NxT[row, :n], False))
        texts.append(out.texts[row])
        row += 1
      if qi >= len(fresh_qids):
        rep = replays[qi - len(fresh_qids)]
        old = rep.behaviour_logp if cfg.algo.is_correction else rep.current_logp
        members.append((rep.tokens, old, True))
        texts.append(st.tokenizer.decode(rep.tokens, skip_special_tokens=True))
      groups.append(members)

    # 5. Rewards (the replayed trajectory is re-scored with its group).
    t = time.time()
    rewards_N, reward_stats = st.score(qids, k, texts)
    rewards_QxK = rewards_N.reshape(len(qids), k)
    timings["reward"] = time.time() - t

    # 6. Advantages.
    adv_QxK = np.asarray(advantages.ADVANTAGES.get(cfg.algo.advantage)(rewards_QxK))

    # 7. Buffer update; behaviour log-probs are the rollout's (temperature 1).
    t = time.time()
    trajectories = [[(m[0], m[1]) for m in g] for g in groups]
    summary = st.buffer.update(qids, rewards_QxK, trajectories, step,
                               collect=st.replay_started)
    retired = st.buffer.retired
    st.stream.retire(sorted({q for q in qids if q in retired}))
    timings["buffer"] = time.time() - t

    # 8. Learner.
    t = time.time()
    if not self._old_logps_from_rollout():
      groups = self._recompute_old_logps(groups, qids)
    timings["old_logprobs"] = time.time() - t
    t = time.time()
    actor = self._update(groups, qids, adv_QxK, rng)
    timings["update_actor"] = time.time() - t

    # 9. Delayed start.
    accuracy = float(rewards_QxK.mean())
    if not st.replay_started and accuracy > cfg.algo.delayed_start:
      st.replay_started = True
    st.step = step
    timings["step"] = time.time() - t_step

    lengths = np.array([len(m[0]) for g in groups for m in g if not m[2]])
    is_replay_N = np.array([m[2] for g in groups for m in g])
    metrics = {
        "batch/solved": accuracy,
        # Without the replayed members, which are correct by construction.
        "batch/fresh_solved": float(rewards_N[~is_replay_N].mean()),
        "batch/solve_all": float((rewards_QxK.min(1) >= 1).mean()),
        "batch/solve_none": float((rewards_QxK.max(1) <= 0).mean()),
        "batch/replay_started": float(st.replay_started),
        "experience/batch_size": len(replays),
        "experience/picked_candidates_mean": (np.mean([r.num_candidates for r in replays])
                                              if replays else 0.0),
        "experience/newly_retired": summary["retired"],
        "experience/stored": summary["stored"],
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(np.mean(out.truncated_N)),
        "timing_s/tokens_per_s": float(lengths.sum() / max(timings["gen"], 1e-9)),
    }
    for name, value in st.buffer.stats().items():
      metrics[f"{name}_count" if name.startswith("bucket/") else f"experience/{name}"] = value
    metrics.update({f"reward/{k_}": v for k_, v in reward_stats.items()})
    metrics.update({f"timing_s/{k_}": v for k_, v in timings.items()})
    metrics.update({f"actor/{k_}": v for k_, v in actor.items()})
    return metrics

  def _old_logps_from_rollout(self) -> bool:
    """Rollout log-probs are pi_old exactly when sampling is the plain softmax."""
    r = self.config.rollout
    return r.temperature == 1.0 and r.top_p >= 1.0 and r.top_k == 0

  def _recompute_old_logps(self, groups, qids):
    """pi_old of fresh responses under the current params (non-plain sampling)."""
    st, cfg = self.state, self.config
    fresh = [(gi, mi) for gi, g in enumerate(groups) for mi, m in enumerate(g) if not m[2]]
    rows = [(st.prompt_ids(qids[gi]), groups[gi][mi][0], None) for gi, mi in fresh]
    logp, _, mask = experience.score_rows(rows, cfg=st.model_cfg, params=st.params,
                                          max_new_tokens=cfg.rollout.max_new_tokens,
                                          batch_size=cfg.optim.micro_batch_size,
                                          pad_id=st.pad_id, chunk=cfg.train.logprob_chunk,
                                          pack=cfg.train.packing)
    groups = [list(g) for g in groups]
    for (gi, mi), lp, m in zip(fresh, logp, mask):
      tokens, _, is_replay = groups[gi][mi]
      groups[gi][mi] = (tokens, lp[:int(m.sum())], is_replay)
    return groups

  def _update(self, groups, qids, adv_QxK, rng) -> dict:
    """Splits the B*K responses into mini-batches and takes one optimizer step each."""
    cfg, st = self.config, self.state
    responses = [packing.Response(st.prompt_ids(qids[gi]), m[0], m[1], adv_QxK[gi, mi], m[2])
                 for gi, g in enumerate(groups) for mi, m in enumerate(g)]
    order = rng.permutation(len(responses))
    prompt_len = padding.prompt_bucket(max(len(r.prompt) for r in responses))
    micro = cfg.optim.micro_batch_size
    per_mini = -(-len(responses) // cfg.optim.mini_batches)
    metrics = []
    for part in np.array_split(order, cfg.optim.mini_batches):
      batch = packing.train_batch(
          [responses[i] for i in part], prompt_len=prompt_len,
          response_len=cfg.rollout.max_new_tokens, micro_batch=micro,
          num_micro=-(-per_mini // micro), pad_id=st.pad_id, aggregation=cfg.algo.aggregation,
          norm_len=cfg.algo.norm_len, pack=cfg.train.packing)
      st.params, st.opt_state, m = learner.train_step(
          st.params, st.opt_state, batch, cfg=st.model_cfg, algo=self._algo,
          optim=self._optim, use_clip=(not st.replay_started
                                       or cfg.algo.clip_after_delayed_start),
          chunk=cfg.train.logprob_chunk)
      metrics.append(m)
    # One device->host transfer per step, after both optimizer steps are queued.
    metrics = jax.device_get(metrics)
    merged = {name: float(np.mean([m[name] for m in metrics])) for name in metrics[0]}
    merged["skipped"] = float(np.sum([m["skipped"] for m in metrics]))
    merged["lr"] = cfg.optim.lr
    return merged

  # --- the loop -----------------------------------------------------------------------------

  def _request_stop(self, signum, frame):  # pylint: disable=unused-argument
    self._stop_requested = True

  def _stop_on_all_processes(self) -> bool:
    # A SIGTERM may reach one host only; all must stop (and checkpoint) at the same step.
    self._stop_requested = distributed.any_process(self._stop_requested)
    return self._stop_requested

  def _export(self) -> None:
    """The final policy as an HF directory (`<workdir>/<train.export_dir>`)."""
    st = self.state
    dst = os.path.join(self.workdir, self.config.train.export_dir)
    if jax.process_count() > 1:
      print(f"multi-host run: export with `python -m exgrpo_jax.convert --src "
            f"{self.workdir} --dst {dst}`", flush=True)
      return
    t = time.time()
    models.save_pretrained(st.model_cfg, st.params, dst, tokenizer_src=st.tokenizer_source)
    print(f"exported step {st.step} to {dst} ({time.time() - t:.1f} s)", flush=True)

  def run(self) -> dict:
    """Trains until `train.steps`; checkpoints, evaluates and logs along the way."""
    cfg, st = self.config, self.state
    previous = signal.signal(signal.SIGTERM, self._request_stop)
    metrics = {}
    try:
      while st.step < cfg.train.steps and not self._stop_on_all_processes():
        metrics = self.train_step()
        if cfg.eval.every and st.step % cfg.eval.every == 0:
          metrics.update(st.evaluate(self.engine))
        self.log.write(st.step, metrics)
        if st.step % cfg.train.log_every == 0:
          self.log.progress(st.step, metrics)
        if st.step % cfg.train.checkpoint_every == 0 or st.step == cfg.train.steps:
          st.save()
        if st.step == cfg.train.steps and cfg.train.export_dir:
          self._export()
      if self._stop_requested:
        print(f"SIGTERM: checkpoint at step {st.step}; exiting", flush=True)
        if st.store.latest_step() != st.step:
          st.save()
    finally:
      signal.signal(signal.SIGTERM, previous)
      self.log.close()
      st.close()
    return metrics
