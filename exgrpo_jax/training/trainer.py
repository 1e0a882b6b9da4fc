"""The ExGRPO training loop (docs/algorithm.md §2), one training step at a time.

  trainer = Trainer(config, workdir)      # resumes from <workdir>/checkpoints if present
  trainer.run()

A step is six phases over a list of `groups.Group` records: compose the batch (steps
1-3: fresh questions plus Gaussian-sampled replays after the delayed start, each with
its lowest-entropy stored trajectory under the current policy), roll out (4: K fresh
samples, K-1 for a replayed question; pi_old from the rollout or recomputed, see
`phase.recompute_old_logps`), grade (5-6: rewards in worker processes, group
advantages), remember (7: retire K/K, bucket and store 1..K-1), learn (8:
`optim.mini_batches` jitted AdamW steps) and update the phase (9: the delayed start).
Metrics go to JSONL/TensorBoard, checkpoints are written every `train.checkpoint_every`
steps or `train.checkpoint_every_minutes`, whichever comes first, and on SIGTERM /
Ctrl-C, exports every `train.export_every_minutes` and at the end, and the run evaluates
on `eval.source` every `eval.every` steps and at the last one (`eval.every = 0`: never),
and at step 0 per `eval.before_train` (`evaluates_before_training`). With
`train.budget_hours` the last step is the one after which another would not fit
(budget.py). A line goes to stderr before each first compile and each evaluation
(announce.py). The workdir is locked for the run; a non-finite loss stops it
(run_guard.py).
"""

import contextlib
import os
import time

import jax
import numpy as np

from exgrpo_jax import advantages
from exgrpo_jax import distributed
from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax import workdir_lock
from exgrpo_jax.models import export
from exgrpo_jax.replay import buckets
from exgrpo_jax.sampling import vllm_setup
from exgrpo_jax.training import actor as actor_lib
from exgrpo_jax.training import announce
from exgrpo_jax.training import budget
from exgrpo_jax.training import config_check
from exgrpo_jax.training import grading
from exgrpo_jax.training import lora_run
from exgrpo_jax.training import groups as groups_lib
from exgrpo_jax.training import phase
from exgrpo_jax.training import run_guard
from exgrpo_jax.training import run_log
from exgrpo_jax.training import run_state


# The JAX engine's counts of a step's rollout, logged as rollout/<name>: rows preempted
# for want of KV pages, and the tokens they had emitted, prefilled again on resuming.
_ROLLOUT_COUNTS = ("preemptions", "recomputed_tokens")


def _refused_start_leftovers(workdir: str) -> list[str]:
  """The directories a start creates that a refused start removes again (if empty),
  innermost first: `checkpoints/`, and the workdir itself, where they do not exist yet."""
  directories = [os.path.join(workdir, "checkpoints"), workdir]
  return [d for d in directories if not os.path.exists(d)]


def evaluates_before_training(eval_cfg) -> bool:
  """`eval.before_train`: None (the default) evaluates at step 0 whenever `eval.every`
  is above 0; True also with `eval.every = 0` (the only evaluation then); False never."""
  return eval_cfg.every > 0 if eval_cfg.before_train is None else eval_cfg.before_train


@contextlib.contextmanager
def _timed(timings: dict, name: str):
  start = time.time()
  yield
  timings[name] = time.time() - start


class Trainer:
  """Owns the run: state, rollout engine, grader and the bound learner."""

  def __init__(self, config, workdir: str, engine=None, estimate=budget.unplanned):
    started = time.monotonic()  # the budget's and the wall-time cadences' start
    config_check.check(config)
    config_check.check_export_dir(config, workdir)
    # `estimate(config)`: the budget's step estimate and its note (the entry point's is
    # the plan's, exgrpo_jax.aot.plan_step: the planner's package sits above this one).
    self.clock = budget.RunClock(config, started, *estimate(config))
    self.notices = announce.Notices()  # before anything compiles
    for line in config_check.ignored(config):
      self.notices.say(f"warning: {line}")
    self.config = config
    self.workdir = workdir
    # Scoped to the trainer's programs (rollout, scoring, step, eval), not the process.
    self.matmul_precision = models.matmul_precision(config.model.matmul_precision,
                                                    config.model.dtype)
    # Before anything is read or written: a second trainer here is refused.
    left_behind = _refused_start_leftovers(workdir)
    self._lock = workdir_lock.WorkdirLock.acquire(workdir, primary=jax.process_index() == 0)
    self._opened = []  # the close() of what _start has opened so far
    try:
      self._start(config, workdir, engine)
    except BaseException:
      # A start refused or failed before any step leaves the workdir as it found it.
      for close in reversed(self._opened):
        close()
      self._lock.release(remove=True)
      for directory in left_behind:
        if os.path.isdir(directory) and not os.listdir(directory):
          os.rmdir(directory)
      raise
    self._stop_requested = False
    self.preempted = False  # stopped by SIGTERM / Ctrl-C before train.steps

  def _start(self, config, workdir: str, engine) -> None:
    """Everything a run needs before its first step: state, engine, grader, learner, log."""
    self.state = st = run_state.RunState.create_or_restore(config, workdir)
    self._opened.append(st.close)
    run_guard.check_context([len(p.ids) for p in st.prompts], config.rollout.max_new_tokens,
                            st.model_cfg)
    # max_rows and kv_pages bound the JAX sampler's KV cache (docs/aot.md, "Memory plan").
    r = config.rollout
    options = (dict(max_rows=r.max_rows or None, scheduler=r.scheduler,
                    kv_pages=r.kv_pages or None, kv_headroom=r.kv_headroom)
               if r.engine == "jax" else {"options": vllm_setup.VllmOptions.from_config(config)})
    self._owns_engine = engine is None
    self.engine = engine or sampling.make_engine(config.rollout.engine, st.model_cfg,
                                                 st.tokenizer, **options)
    if self._owns_engine:
      self._opened.append(self.engine.close)
    self.grader = grading.Grader(config)
    self._opened.append(self.grader.close)
    self.actor = actor_lib.Actor(config, st.model_cfg, st.pad_id)
    run_guard.warn_gpu_memory_fraction(config.rollout.engine)
    run_log.truncate(workdir, st.step, evaluates_before_training(config.eval))  # each step once
    self.log = run_log.RunLog(workdir, config.train.steps, start_step=st.step,
                              loggers=config.train.loggers, config=config.to_dict())

  # --- one training step --------------------------------------------------------------------

  def train_step(self) -> dict:
    with jax.default_matmul_precision(self.matmul_precision):
      return self._train_step()

  def _train_step(self) -> dict:
    st = self.state
    timings, t_step = {}, time.time()
    step = st.step + 1
    rng = np.random.default_rng([self.config.train.seed, step])
    with _timed(timings, "select"):
      groups = self.compose(rng)
    stats = getattr(self.engine, "stats", {})
    before = {k: stats[k] for k in _ROLLOUT_COUNTS if k in stats}
    with _timed(timings, "gen"):
      self.roll_out(groups, step)
    rollout = {f"rollout/{k}": stats[k] - v for k, v in before.items()}
    with _timed(timings, "old_logprobs"):
      self.old_logps(groups)
    with _timed(timings, "reward"):
      reward_stats = self.grade(groups)
    with _timed(timings, "buffer"):
      summary = self.remember(groups, step)
    with _timed(timings, "update_actor"):
      actor = self.learn(groups, rng)
    self.update_phase(float(groups_lib.rewards_QxK(groups).mean()))
    st.step = step
    timings["step"] = time.time() - t_step
    return dict(self._metrics(groups, summary, reward_stats, actor, timings), **rollout)

  def compose(self, rng: np.random.Generator) -> list[groups_lib.Group]:
    """Steps 1-3: fresh groups (no responses yet), then replay groups holding the
    trajectory chosen for them."""
    cfg, st = self.config, self.state
    batch_q = cfg.train.batch_questions
    n_exp = phase.num_replayed(st.replay_started, cfg.algo.rho, batch_q,
                               st.buffer.num_candidates)
    replay_prompts = [st.prompt(int(q)) for q in st.buffer.sample_questions(n_exp)]
    replays = self.actor.choose_replays(st.params, st.buffer, replay_prompts, rng)
    fresh = [groups_lib.Group(st.prompt(q.uid), [])
             for q in st.stream.next_batch(batch_q - len(replays))]
    for prompt, rep in zip(replay_prompts, replays):
      old = rep.behaviour_logp if cfg.algo.is_correction else rep.current_logp
      text = st.tokenizer.decode(rep.tokens, skip_special_tokens=True)
      fresh.append(groups_lib.Group(
          prompt, [groups_lib.Response(rep.tokens, old, text, is_replay=True)],
          replay_candidates=rep.num_candidates))
    return fresh

  def roll_out(self, groups, step: int) -> None:
    """Step 4: fills each group to K with fresh samples (before a replayed member)."""
    cfg, st = self.config, self.state
    counts = [cfg.rollout.k - len(g.responses) for g in groups]
    key = jax.random.fold_in(jax.random.key(cfg.train.seed), step)
    out = self.engine.generate([g.prompt_ids for g in groups], counts, st.params, key,
                               st.sampling_config)
    row = 0
    for group, count in zip(groups, counts):
      samples = []
      for _ in range(count):
        n = int(out.lengths_N[row])
        samples.append(groups_lib.Response(out.tokens_NxT[row, :n], out.logprobs_NxT[row, :n],
                                           out.texts[row],
                                           truncated=bool(out.truncated_N[row])))
        row += 1
      group.responses[:0] = samples

  def old_logps(self, groups) -> None:
    """pi_old of the fresh responses (also what the buffer stores), when recomputed.

    Under `phase.recompute_old_logps` the learner's forward pass at temperature 1 under
    the step-start params replaces the rollout's log-probs; the same pass gives the
    learner's log-probs at the rollout temperature, which set each response's
    `rollout_log_ratio` against the rollout's.
    """
    if not phase.recompute_old_logps(self.config):
      return
    fresh = [(g.prompt_ids, r) for g in groups for r in g.responses if not r.is_replay]
    logps, at_rollout_temperature = self.actor.score(self.state.params,
                                                     [(p, r.tokens) for p, r in fresh])
    for (_, r), logp, learner_logp in zip(fresh, logps, at_rollout_temperature):
      r.rollout_log_ratio = learner_logp - r.old_logp  # old_logp: still the rollout's
      r.old_logp = logp

  def grade(self, groups) -> dict:
    """Steps 5-6: rewards (replayed members re-scored with their group), advantages."""
    stats = self.grader.grade(groups)
    adv_QxK = np.asarray(advantages.ADVANTAGES.get(self.config.algo.advantage)(
        groups_lib.rewards_QxK(groups)))
    for g, adv_K in zip(groups, adv_QxK):
      g.advantages = adv_K
    return stats

  def remember(self, groups, step: int) -> dict:
    """Step 7: retire K/K questions; after the delayed start, bucket and store 1..K-1.

    The on-policy baseline (rho = 0, `grpo` loss: `phase.keeps_buffer`) never replays,
    so it neither stores nor retires: every question stays in the fresh stream, as in
    plain Dr.GRPO.
    """
    cfg, st = self.config, self.state
    if not phase.keeps_buffer(cfg.algo):
      return dict(retired=0, stored=0, duplicates=0, evicted=0)
    rewards_QxK = groups_lib.rewards_QxK(groups)
    buckets_Q = (buckets.std_buckets(rewards_QxK) if cfg.replay.bucketing == "reward_std"
                 else None)
    qids = [g.question_id for g in groups]
    summary = st.buffer.update(qids, rewards_QxK,
                               [[(r.tokens, r.old_logp) for r in g.responses] for g in groups],
                               step, collect=st.replay_started, buckets_Q=buckets_Q)
    retired = st.buffer.retired
    st.stream.retire(sorted({q for q in qids if q in retired}))
    return summary

  def learn(self, groups, rng: np.random.Generator) -> dict:
    """Step 8: `optim.mini_batches` optimizer steps over the groups' responses."""
    st = self.state
    st.params, st.opt_state, metrics = self.actor.update(
        st.params, st.opt_state, groups,
        phase.use_clip(st.replay_started, self.config.algo.clip_after_delayed_start), rng)
    return metrics

  def update_phase(self, accuracy: float) -> None:
    """Step 9: replay switches on for good once batch accuracy exceeds the threshold."""
    st = self.state
    st.replay_started = phase.replay_started(st.replay_started, accuracy,
                                             self.config.algo.delayed_start)

  def _metrics(self, groups, summary, reward_stats, actor, timings) -> dict:
    st = self.state
    rewards_QxK = groups_lib.rewards_QxK(groups)
    members = groups_lib.responses(groups)
    rewards_N = rewards_QxK.reshape(-1)
    is_replay_N = np.array([r.is_replay for r in members])
    fresh = [r for r in members if not r.is_replay]
    lengths = np.array([len(r.tokens) for r in fresh])
    replayed = [g.replay_candidates for g in groups if g.is_replay]
    correct_QxK = rewards_QxK >= self.config.reward.correct_threshold
    replay_Q = np.array([g.is_replay for g in groups])
    metrics = {
        "batch/solved": float(rewards_QxK.mean()),
        # Without the replayed members, which are correct by construction.
        "batch/fresh_solved": float(rewards_N[~is_replay_N].mean()),
        "batch/solve_all": float(correct_QxK.all(1).mean()),
        "batch/solve_none": float((~correct_QxK).all(1).mean()),
        "batch/replay_started": float(st.replay_started),
        "experience/batch_size": len(replayed),
        "experience/picked_candidates_mean": np.mean(replayed) if replayed else 0.0,
        # Replay groups solved K/K: zero advantage, so their replayed member teaches
        # nothing (0 when none was replayed).
        "experience/replay_solve_all": (float(correct_QxK[replay_Q].all(1).mean())
                                        if replay_Q.any() else 0.0),
        "experience/newly_retired": summary["retired"],
        "experience/stored": summary["stored"],
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(np.mean([r.truncated for r in fresh])),
        "timing_s/tokens_per_s": float(lengths.sum() / max(timings["gen"], 1e-9)),
    }
    for name, value in st.buffer.stats().items():
      metrics[f"{name}_count" if name.startswith("bucket/") else f"experience/{name}"] = value
    metrics.update({f"reward/{k_}": v for k_, v in reward_stats.items()})
    metrics.update({f"timing_s/{k_}": v for k_, v in timings.items()})
    metrics.update({f"actor/{k_}": v for k_, v in actor.items()})
    return metrics

  # --- the loop -----------------------------------------------------------------------------

  def _stop_on_all_processes(self, stop: run_guard.StopSignals) -> bool:
    # A SIGTERM may reach one host only; all must stop (and checkpoint) at the same step.
    self._stop_requested = distributed.any_process(stop.requested is not None)
    return self._stop_requested

  def _due(self, cadence: budget.Cadence) -> bool:
    # Each process's clock differs a little; all must checkpoint at the same step.
    return bool(cadence.minutes) and distributed.any_process(cadence.due(time.monotonic()))

  def _budget_spent(self, evaluating: bool) -> bool:
    """Whether the step just taken is the budget's last (then says so)."""
    if not self.config.train.budget_hours:
      return False
    spent = distributed.any_process(
        not self.clock.room_for_another(time.monotonic(), evaluating))
    if spent:
      self.notices.say(self.clock.stop_line(self.state.step, time.monotonic()))
    return spent

  def _save(self) -> None:
    with self.clock.checkpoint.timed():
      self.state.save()

  def _export(self) -> None:
    """The policy as an HF directory (`<workdir>/<train.export_dir>`)."""
    st = self.state
    dst = os.path.join(self.workdir, self.config.train.export_dir)
    with self.clock.export.timed():
      if jax.process_count() > 1:
        print(f"multi-host run: export with `python -m exgrpo_jax.convert --src "
              f"{self.workdir} --dst {dst}`", flush=True)
        return
      t = time.time()
      base = lora_run.adapter_base(self.config) if lora_run.enabled(self.config) else ""
      models.save_pretrained(st.model_cfg, st.params, dst, tokenizer_src=st.tokenizer_source,
                             info={"step": st.step}, adapter_base=base)
      print(f"exported step {st.step} to {dst} ({time.time() - t:.1f} s)", flush=True)

  def _evaluate(self) -> dict:
    """val/* metrics; a few graded completions go to the run log."""
    self.notices.evaluating(self.state.step, len(self.grader.eval_questions()),
                            self.config.eval.n, jax_sampler=self.config.rollout.engine == "jax")
    with self.clock.evaluation.timed(), jax.default_matmul_precision(self.matmul_precision):
      metrics = self.grader.validate(self.engine, self.state.params, self.state.tokenizer)
    self.log.eval_samples(self.state.step, self.grader.eval_responses)
    return metrics

  def run(self) -> dict:
    """Trains until `train.steps` or the budget's last step; checkpoints, evaluates,
    exports and logs along the way."""
    cfg, st, clock = self.config, self.state, self.clock
    metrics, last, first_step = {}, False, st.step
    try:
      with run_guard.StopSignals() as stop:
        if st.step == 0 and evaluates_before_training(cfg.eval):
          start = self._evaluate()
          self.log.write(0, start)
          self.log.progress(0, start)
        if cfg.train.budget_hours:
          problems = len(self.grader.eval_questions()) if cfg.eval.every else 0
          for line in clock.start_lines(st.step, problems, time.monotonic()):
            self.notices.say(line)
        while not last and st.step < cfg.train.steps and not self._stop_on_all_processes(stop):
          self.notices.compiling(f"step {st.step + 1}", (
              "the rollout, scoring and train-step programs" if cfg.rollout.engine == "jax"
              else "the scoring and train-step programs"))
          metrics = self.train_step()
          clock.stepped(metrics["timing_s/step"], time.monotonic())
          evaluating = bool(cfg.eval.every) and st.step % cfg.eval.every == 0
          last = st.step == cfg.train.steps or self._budget_spent(evaluating)
          if cfg.eval.every and (evaluating or last):
            metrics.update(self._evaluate())
          self.log.write(st.step, metrics)
          run_guard.check_finite(st.step, metrics, st.store.latest_step())
          if st.step % cfg.train.log_every == 0:
            self.log.progress(st.step, metrics, clock.eta_s(st.step, time.monotonic()))
          saving = (st.step % cfg.train.checkpoint_every == 0 or last
                    or self._due(clock.checkpoint))
          if saving:
            self._save()
          if cfg.train.budget_hours and not last and (saving or st.step == first_step + 2):
            self.notices.say(clock.progress_line(st.step, time.monotonic()))
          if not last and self._due(clock.export):
            self._export()
        if self._stop_requested and st.step < cfg.train.steps:
          print(f"{stop.requested or 'stop'}: checkpoint at step {st.step}; exiting",
                flush=True)
          if st.store.latest_step() != st.step:
            self._save()
          self.preempted = True
        elif cfg.train.export_dir and not export.is_complete(
            os.path.join(self.workdir, cfg.train.export_dir), {"step": st.step}):
          self._export()  # also redoes an export that a killed run left unfinished
    finally:
      self.close()
      self._lock.release(remove=True)  # a lock file left behind would name a dead pid
    return metrics

  def close(self) -> None:
    """Closes the log, the reward workers, the checkpoint store and an engine it built."""
    if self._owns_engine:
      self.engine.close()
    self.log.close()
    self.grader.close()
    self.state.close()
