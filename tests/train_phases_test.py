"""The phases of a training step, each on its own (docs/algorithm.md §3, §6, §10, §11, §13).

Pure rules first (n_exp, the strict delayed-start threshold, clipping), then phases of
a real `Trainer` on configs/tiny.py: the real JAX sampler (temperature 0.7; bfloat16),
real rewards in worker processes, the real buffer.
"""

import jax
import numpy as np
import pytest

from configs import smollm2_135m
from exgrpo_jax.replay import buckets
from exgrpo_jax.training import announce
from exgrpo_jax.training import experience
from exgrpo_jax.training import phase
from exgrpo_jax.training import run_log
from exgrpo_jax.training import trainer as trainer_lib
from tests import trainer_test


@pytest.mark.parametrize("rho, batch, candidates, expected", [
    (0.5, 4, 10, 2), (0.5, 5, 10, 2), (0.75, 4, 10, 3), (0.5, 128, 7, 7), (0.25, 3, 5, 0),
    (0.0, 8, 5, 0), (1.0, 4, 0, 0),
])
def test_num_replayed_is_min_of_floor_rho_b_and_candidates(rho, batch, candidates,
                                                            expected):
  assert phase.num_replayed(True, rho, batch, candidates) == expected
  assert phase.num_replayed(False, rho, batch, candidates) == 0  # before the start


def test_delayed_start_threshold_is_strict_and_final():
  assert not phase.replay_started(False, 0.35, 0.35)
  assert phase.replay_started(False, np.nextafter(0.35, 1), 0.35)
  assert phase.replay_started(True, 0.0, 0.35)  # on for good
  assert not phase.replay_started(False, 0.0, 0.0)  # (0 starts at construction instead)


def test_clipping_switches_with_the_phase():
  assert phase.use_clip(False, False) and phase.use_clip(False, True)
  assert not phase.use_clip(True, False)
  assert phase.use_clip(True, True)


@pytest.mark.parametrize("overrides, recompute", [
    ({}, False),
    ({"model.dtype": "bfloat16"}, True),
    ({"rollout.temperature": 0.7}, True),
    ({"rollout.engine": "vllm"}, True),
    ({"model.dtype": "bfloat16", "algo.old_logp_source": "rollout"}, False),
    ({"algo.old_logp_source": "recompute"}, True),
    ({"algo.tis_cap": 2.0}, True),  # TIS weighs the rollout against the recompute
])
def test_old_logp_source(overrides, recompute):
  config = trainer_test.tiny.get_config()
  for key, value in overrides.items():
    section, name = key.split(".")
    config[section][name] = value
  assert phase.recompute_old_logps(config) == recompute


def _trainer(tmp_path, engine=None, **overrides):
  config = trainer_test.tiny.get_config()
  config.reward.plugins = "tests.reward_plugins"
  config.reward.name = "test_even_length"  # mixed groups from a random model
  for key, value in overrides.items():
    section, name = key.split("__")
    config[section][name] = value
  trainer = trainer_lib.Trainer(config, str(tmp_path), engine=engine)
  if engine is not None:
    engine.state = trainer.state
  return trainer


def _teacher_forced(trainer, params, prompt_ids, tokens_list):
  """Temperature-1 log-probs of each response, one sequence per row (no packing)."""
  st = trainer.state
  s = experience.score_rows(
      [(p, t, None) for p, t in zip(prompt_ids, tokens_list)], cfg=st.model_cfg,
      params=params, max_new_tokens=trainer.config.rollout.max_new_tokens, batch_size=8,
      pad_id=st.pad_id, chunk=8, pack=False)
  return [lp[:int(m.sum())] for lp, m in zip(s.logp_SxR, s.mask_SxR)]


def test_buffer_stores_temperature_one_behaviour_logps(tmp_path):
  """At T = 0.7 the sampler's log-probs are of the scaled distribution; the buffer must
  hold the behaviour policy's temperature-1 log-probs (up to its 2^-11 quantisation)."""
  trainer = _trainer(tmp_path, rollout__temperature=0.7)
  try:
    st = trainer.state
    params = jax.tree.map(np.array, st.params)  # the behaviour policy (params are donated)
    trainer.train_step()
    stored = [(q, t) for q in st.buffer.question_ids for t in st.buffer.candidates(q)]
    assert stored, "no mixed group at step 1: the test needs stored trajectories"
    expected = _teacher_forced(trainer, params, [list(st.prompt(q).ids) for q, _ in stored],
                               [t.token_ids for _, t in stored])
    for (_, t), want in zip(stored, expected):
      np.testing.assert_allclose(t.logps, want, atol=2 ** -11 + 1e-6)
  finally:
    trainer.close()


def test_bfloat16_fresh_ratio_is_one_at_step_start(tmp_path):
  """Under the defaults, pi_old of fresh tokens is the learner's own forward pass: in
  bfloat16 the ratio at the step's first (here: only) optimizer step is 1 to float32
  round-off, though the sampler's bfloat16 decode log-probs differ from it."""
  trainer = _trainer(tmp_path, model__dtype="bfloat16", optim__mini_batches=1)
  try:
    metrics = trainer.train_step()
    assert metrics["actor/on_tokens"] > 0
    np.testing.assert_allclose(metrics["actor/on_ratio_mean"], 1.0, rtol=0, atol=1e-6)
    np.testing.assert_allclose(metrics["actor/on_ratio_max"], 1.0, rtol=0, atol=1e-6)
    np.testing.assert_allclose(metrics["actor/ppo_kl"], 0.0, atol=1e-6)
  finally:
    trainer.close()


def test_mismatch_compares_the_rollout_temperature_on_both_sides(tmp_path):
  """At T = 0.7 (float32) pi_old is recomputed at temperature 1, and the mismatch
  metrics, logged with TIS off, set the sampler's log-probs against the learner's at
  0.7 from the same pass: about 0 (2e-7 nats), where the learner's temperature-1
  log-probs would be off by 0.05 nats on average on this near-uniform random model."""
  trainer = _trainer(tmp_path, rollout__temperature=0.7, optim__mini_batches=1)
  try:
    metrics = trainer.train_step()
    assert metrics["actor/on_tokens"] > 0 and "actor/tis_clipfrac" not in metrics
    assert metrics["actor/mismatch_logp_abs_mean"] < 1e-5
    np.testing.assert_allclose(metrics["actor/mismatch_ratio_max"], 1.0, atol=1e-4)
  finally:
    trainer.close()


def test_remember_with_reward_std_buckets_then_compose(tmp_path):
  """The continuous-reward variant: buckets from per-question reward std, and
  correctness from reward.correct_threshold. Then step 1 on the filled buffer: no
  replay before the start; after it, n_exp replay groups, each holding one stored
  trajectory and filled to K by the rollout."""
  engine = trainer_test.ScriptedEngine()
  trainer = _trainer(tmp_path, engine, replay__bucketing="reward_std",
                     reward__correct_threshold=0.5)
  try:
    rng = np.random.default_rng(0)
    groups = trainer.compose(rng)
    trainer.roll_out(groups, 1)
    trainer.grade(groups)
    rewards_QxK = np.array([[0.9, 0.2, 0.6, 0.4], [0.5, 0.5, 0.5, 0.5],
                            [1.0, 0.0, 0.0, 0.0], [0.7, 0.6, 0.1, 0.3]])
    for g, r in zip(groups, rewards_QxK):
      g.rewards = r
    summary = trainer.remember(groups, 1)
    expected = buckets.std_buckets(rewards_QxK)
    stored = 0
    for g, b, r in zip(groups, expected, rewards_QxK):
      if 0 < b < 4:
        assert trainer.state.buffer.bucket(g.question_id) == b
        stored += int((r >= 0.5).sum())
      else:
        assert g.question_id not in trainer.state.buffer.question_ids
    assert stored > 0 and summary["stored"] == stored
    # 4 of 4 at or above the threshold: retired, though no reward is 1.
    assert groups[1].question_id in trainer.state.buffer.retired

    st = trainer.state
    candidates = st.buffer.num_candidates
    st.replay_started = False
    assert not any(g.is_replay for g in trainer.compose(rng))
    st.replay_started = True
    groups = trainer.compose(rng)
    replayed = [g for g in groups if g.is_replay]
    assert len(groups) == 4 and len(replayed) == min(2, candidates) > 0
    for g in replayed:
      assert g.question_id in st.buffer.question_ids and len(g.responses) == 1
      assert any(np.array_equal(g.responses[0].tokens, t.token_ids)
                 for t in st.buffer.candidates(g.question_id))
    trainer.roll_out(groups, 2)
    assert all(len(g.responses) == 4 for g in groups)
    assert all(g.responses[-1].is_replay for g in replayed)
  finally:
    trainer.close()


@pytest.mark.slow  # compiles the sampler for the evaluation batch
def test_validation_metrics(tmp_path, shared_data_dir):
  """`Grader.validate`: the run's periodic evaluation on `eval.path` (val/* metrics)."""
  trainer = _trainer(tmp_path, eval__path=f"{shared_data_dir}/gsm8k_test.parquet",
                     eval__limit=2, eval__every=1)
  try:
    st = trainer.state
    metrics = trainer.grader.validate(trainer.engine, st.params, st.tokenizer)
    assert set(metrics) == {"val/test_score/gsm8k", "val/avg_score",
                            "val/response_length"}
    assert 0 <= metrics["val/avg_score"] <= 1 and metrics["val/response_length"] > 0
  finally:
    trainer.close()


@pytest.mark.slow  # compiles the sampler for two evaluation batches
def test_validation_with_greedy_pass_scores_as_a_greedy_validation(tmp_path):
  """`eval.greedy`: val/greedy_score is what a validation at temperature 0 reports as
  val/avg_score on the same questions, beside the sampled avg@n."""
  sampled = _trainer(tmp_path / "sampled", eval__source="arithmetic", eval__limit=8,
                     eval__temperature=0.6, eval__n=2, eval__greedy=True)
  greedy = _trainer(tmp_path / "greedy", eval__source="arithmetic", eval__temperature=0.0,
                    eval__limit=8)
  try:
    both = sampled.grader.validate(sampled.engine, sampled.state.params,
                                   sampled.state.tokenizer)
    alone = greedy.grader.validate(greedy.engine, greedy.state.params,
                                   greedy.state.tokenizer)
    assert "val/greedy_score" not in alone
    assert both["val/greedy_score"] == alone["val/avg_score"]
    assert {k.replace("greedy_score", "test_score") for k in both
            if k.startswith("val/greedy_score/")} == {k for k in alone
                                                     if k.startswith("val/test_score/")}
    assert 0 <= both["val/avg_score"] <= 1
  finally:
    sampled.close()
    greedy.close()


@pytest.mark.parametrize("before_train, evaluated", [(None, False), (True, True)])
def test_eval_every_0_evaluates_only_when_asked(tmp_path, capsys, before_train, evaluated):
  """configs/smollm2_135m.py's evaluation settings with eval.every=0: no evaluation at
  all, unless eval.before_train=True asks for the step-0 one. A line comes before the
  evaluation and before the first compile of the training step."""
  settings = smollm2_135m.get_config().eval
  trainer = _trainer(tmp_path, train__steps=1, train__export_dir="",
                     **{f"eval__{k}": v for k, v in settings.items()})
  trainer.config.eval.update(every=0, limit=4, max_new_tokens=8)
  if before_train is not None:
    trainer.config.eval.before_train = before_train
  trainer.run()
  rows = run_log.read_metrics(str(tmp_path))
  assert [r["step"] for r in rows] == ([0, 1] if evaluated else [1])
  assert not any(k.startswith("val/") for k in rows[-1])
  err = capsys.readouterr().err
  assert ("[exgrpo_jax] step 0: evaluating on 4 problems" in err) == evaluated
  assert err.count("[exgrpo_jax] step 1: compiling the rollout, scoring and train-step "
                   "programs") == 1


@pytest.mark.parametrize("cache, note", [
    (None, "compiling X (compile cache off: every run compiles them)"),
    ("empty", "compiling X (first run; cached for the next in {dir})"),
    ("full", "compiling X, or loading them from the compile cache {dir} (an earlier run's)"),
])
def test_compile_notice_follows_the_cache_as_the_run_found_it(tmp_path, capsys, cache, note):
  directory = str(tmp_path) if cache else None
  if cache == "full":
    (tmp_path / "jit_step-abc").write_bytes(b"compiled")
  previous = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", directory)
  try:
    notices = announce.Notices()
  finally:
    jax.config.update("jax_compilation_cache_dir", previous)
  (tmp_path / "later").write_bytes(b"")  # what the run compiles does not change the note
  notices.compiling("step 1", "X")
  notices.compiling("step 2", "X")  # once per kind of program
  assert capsys.readouterr().err.splitlines() == [
      "[exgrpo_jax] step 1: " + note.format(dir=directory)]


def test_evaluation_on_vllm_says_no_sampler_compile(capsys):
  notices = announce.Notices()
  notices.evaluating(0, 40, 2, jax_sampler=False)
  assert capsys.readouterr().err.splitlines() == [
      "[exgrpo_jax] step 0: evaluating on 40 problems, 2 samples each"]
  notices.evaluating(0, 40, 2)
  assert "compiling the sampler's programs" in capsys.readouterr().err


def test_a_step_logs_the_rollouts_preemptions(tmp_path):
  """rollout.kv_pages of one row at its longest (a prompt bucket of 48 and 48 new
  tokens: 2 pages of 64) for the step's 16 rows: two rows start, and once the first
  needs its second page the other is preempted; the step says how many, and how many of
  their tokens were prefilled again."""
  small = _trainer(tmp_path / "small", rollout__kv_pages=2, rollout__kv_headroom=0.0,
                   rollout__max_new_tokens=48, data__max_prompt_tokens=48,
                   train__export_dir="")
  full = _trainer(tmp_path / "full", rollout__max_new_tokens=48, train__export_dir="")
  try:
    metrics = small.train_step()
    assert metrics["rollout/preemptions"] > 0 and metrics["rollout/recomputed_tokens"] > 0
    metrics = full.train_step()
    assert metrics["rollout/preemptions"] == metrics["rollout/recomputed_tokens"] == 0
  finally:
    small.close()
    full.close()
