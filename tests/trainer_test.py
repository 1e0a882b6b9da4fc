"""The training loop on configs/tiny.py: replay path, on-policy variant, exact resume.

The rollout engine here is scripted (allowed only in unit tests of the learner): a
random tiny model almost never answers a GSM8K question, so the script answers some
rows correctly (`\\boxed{gt}`) and others wrongly, and reports the real teacher-forced
log-probs of its responses under the current params. Everything else is real: the
tokenizer, the data, Math/GSM8K rewards in worker processes, the buffer, the loss,
AdamW and Orbax checkpoints.
"""

import os
import sys

import jax
import numpy as np
import pytest

from exgrpo_jax.sampling import outputs
from exgrpo_jax.training import config_check
from exgrpo_jax.training import experience
from exgrpo_jax.training import run_log
from exgrpo_jax.training import trainer as trainer_lib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import tiny  # pylint: disable=g-import-not-at-top,wrong-import-position


class ScriptedEngine:
  """Row j of a question is correct iff j is even; the batch's first question is
  answered correctly by every row (so it retires)."""

  def __init__(self):
    self.state = None  # the trainer's RunState, set after construction

  def update_weights(self, params):
    del params

  def generate(self, prompt_ids, n, params, key, sampling):
    del key
    st = self.state
    counts = [n] * len(prompt_ids) if isinstance(n, int) else list(n)
    answers = {tuple(p.ids): p.question.ground_truth for p in st.prompts}
    prompts, responses, index = [], [], []
    for i, (ids, count) in enumerate(zip(prompt_ids, counts)):
      gt = answers[tuple(ids)]
      for j in range(count):
        correct = i == 0 or j % 2 == 0
        text = f"Step {j}: the answer is \\boxed{{{gt if correct else gt + '1'}}}."
        resp = st.tokenizer(text, add_special_tokens=False)["input_ids"]
        responses.append(resp[:sampling.max_new_tokens - 1] + [st.tokenizer.eos_token_id])
        prompts.append(ids)
        index.append(i)
    logp = experience.score_rows(
        [(p, r, None) for p, r in zip(prompts, responses)], cfg=st.model_cfg, params=params,
        max_new_tokens=sampling.max_new_tokens, batch_size=8, pad_id=st.pad_id,
        chunk=8).logp_SxR
    lengths = np.array([len(r) for r in responses])
    tokens = np.full((len(responses), sampling.max_new_tokens), st.pad_id, np.int32)
    for i, r in enumerate(responses):
      tokens[i, :len(r)] = r
    return outputs.finalize(tokens, logp, None, lengths,
                            np.ones(len(lengths), bool), np.array(index), st.tokenizer, (),
                            st.pad_id)


class SolvesReplaysEngine(ScriptedEngine):
  """ScriptedEngine, but every fresh row of a replay group (the calls asking K-1 rows of
  a question) is correct, so each replay group is solved K/K."""

  def generate(self, prompt_ids, n, params, key, sampling):
    out = super().generate(prompt_ids, n, params, key, sampling)
    answers = {tuple(p.ids): p.question.ground_truth for p in self.state.prompts}
    counts = [n] * len(prompt_ids) if isinstance(n, int) else list(n)
    for row, question in enumerate(out.prompt_index_N):
      if counts[question] < max(counts):
        out.texts[row] = f"the answer is \\boxed{{{answers[tuple(prompt_ids[question])]}}}."
    return out


class MismatchedEngine(ScriptedEngine):
  """Reports the learner's log-probs minus DELTAS (cycled over each response's tokens),
  as an engine with other kernels might: log pi_old - log pi_rollout is DELTAS."""

  DELTAS = np.array([1.0, -0.5, 0.2])  # ratios e (above a cap of 2), 0.61, 1.22

  def generate(self, prompt_ids, n, params, key, sampling):
    out = super().generate(prompt_ids, n, params, key, sampling)
    self.lengths_N = out.lengths_N
    delta_T = self.DELTAS[np.arange(out.logprobs_NxT.shape[1]) % len(self.DELTAS)]
    out.logprobs_NxT = np.where(out.mask_NxT, out.logprobs_NxT - delta_T, 0)
    return out


def run(workdir, steps, variant="exgrpo", engine=None, **overrides):
  config = tiny.get_config(variant)
  config.train.steps = steps
  config.train.checkpoint_every = 1
  for key, value in overrides.items():
    section, name = key.split("__")
    config[section][name] = value
  engine = engine or ScriptedEngine()
  trainer = trainer_lib.Trainer(config, str(workdir), engine=engine)
  engine.state = trainer.state
  trainer.run()
  return trainer, run_log.read_metrics(str(workdir))


@pytest.fixture(scope="module")
def exgrpo_run(tmp_path_factory):
  return run(tmp_path_factory.mktemp("exgrpo"), steps=3)


class PrecisionRecordingEngine(ScriptedEngine):
  """Records JAX's matmul precision at each rollout and learner step."""

  def __init__(self):
    super().__init__()
    self.seen = []

  def generate(self, prompt_ids, n, params, key, sampling):
    self.seen.append(("rollout", jax.config.jax_default_matmul_precision))
    return super().generate(prompt_ids, n, params, key, sampling)


# By default the bfloat16 case: it differs from the tests' own precision (highest,
# conftest), so it fails if the trainer sets none; the float32 cases are slow.
@pytest.mark.parametrize("dtype,setting,expected", [
    pytest.param("float32", "auto", "highest", marks=pytest.mark.slow),
    ("bfloat16", "auto", "default"),
    pytest.param("float32", "default", "default", marks=pytest.mark.slow)])
def test_the_trainer_runs_its_programs_at_the_configured_matmul_precision(
    tmp_path, monkeypatch, dtype, setting, expected):
  """JAX's default is TF32 for float32 matmuls on NVIDIA GPUs (one bfloat16 pass on TPU);
  float32 means float32 unless the config says otherwise, and only inside the trainer."""
  engine, before = PrecisionRecordingEngine(), jax.config.jax_default_matmul_precision
  learn = trainer_lib.Trainer.learn
  monkeypatch.setattr(trainer_lib.Trainer, "learn", lambda self, *a: (
      engine.seen.append(("learn", jax.config.jax_default_matmul_precision)),
      learn(self, *a))[1])
  run(tmp_path, steps=1, engine=engine, model__dtype=dtype, model__matmul_precision=setting)
  assert engine.seen == [("rollout", expected), ("learn", expected)]
  assert jax.config.jax_default_matmul_precision == before  # the process's is untouched


def test_an_unknown_matmul_precision_is_one_line(tmp_path):
  with pytest.raises(Exception, match=r"model\.matmul_precision='tf32'.*auto, default, high, "
                                      r"highest"):
    run(tmp_path, steps=1, model__matmul_precision="tf32")


def test_replay_path_is_exercised(exgrpo_run):
  trainer, rows = exgrpo_run
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert rows[0]["experience/batch_size"] == 0  # the buffer is empty at step 1
  assert all(r["experience/batch_size"] > 0 for r in rows[1:])
  assert all(r["actor/off_tokens"] > 0 for r in rows[1:])
  assert trainer.state.buffer.stats()["trajectories"] > 0
  assert rows[-1]["experience/retired"] >= 1
  retired = set(trainer.state.buffer.retired)
  assert retired <= set(trainer.state.stream.state_dict()["retired"])
  for r in rows:
    assert np.isfinite(r["actor/pg_loss"]) and r["actor/skipped"] == 0
    # float32 at T = 1: pi_old is the rollout's, so there is no mismatch to measure.
    assert not [k for k in r if "mismatch" in k or "tis_" in k]
    # Replayed members are correct: solved = (fresh correct + replays) / all members.
    n, n_replay = 4 * 4, r["experience/batch_size"]
    np.testing.assert_allclose(r["batch/solved"] * n,
                               r["batch/fresh_solved"] * (n - n_replay) + n_replay)


def test_rollout_mismatch_metrics_and_tis_clipping_are_logged(tmp_path):
  """With TIS on, each step logs the mismatch of its fresh tokens (here exactly the
  engine's DELTAS) and the share of them whose weight the cap clips."""
  engine = MismatchedEngine()
  _, rows = run(tmp_path, steps=1, engine=engine, algo__tis_cap=2.0, train__export_dir="")
  T = tiny.get_config().rollout.max_new_tokens
  delta_NxT = np.stack([MismatchedEngine.DELTAS[np.arange(T) % 3]] * len(engine.lengths_N))
  fresh_NxT = np.arange(T) < engine.lengths_N[:, None]  # step 1 replays nothing
  m = rows[0]
  assert m["actor/on_tokens"] == fresh_NxT.sum()
  np.testing.assert_allclose(m["actor/mismatch_logp_abs_mean"],
                             np.abs(delta_NxT[fresh_NxT]).mean(), rtol=1e-4)
  np.testing.assert_allclose(m["actor/mismatch_ratio_max"], np.e, rtol=1e-4)
  np.testing.assert_allclose(m["actor/tis_clipfrac"], (delta_NxT[fresh_NxT] == 1).mean(),
                             rtol=1e-6)


def test_onpolicy_never_replays_stores_or_retires(tmp_path):
  trainer, rows = run(tmp_path, steps=2, variant="onpolicy")
  assert all(r["experience/batch_size"] == 0 and r["actor/off_tokens"] == 0 for r in rows)
  assert all(r["batch/fresh_solved"] == r["batch/solved"] for r in rows)
  # The script solves each batch's first question 4/4; Dr.GRPO keeps it in the stream.
  assert all(r["batch/solve_all"] > 0 for r in rows)
  assert trainer.state.buffer.stats()["trajectories"] == 0
  assert not trainer.state.buffer.retired
  assert not trainer.state.stream.state_dict()["retired"]


def test_noreplay_retires_and_stores_but_never_replays(tmp_path):
  # ExGRPO's loss at rho = 0: the buffer is kept (the batch's first question is solved
  # 4/4 and retires; the rest are stored) and fresh tokens lose their clip after the
  # delayed start, but nothing is replayed.
  trainer, rows = run(tmp_path, steps=2, variant="noreplay")
  assert all(r["experience/batch_size"] == 0 and r["actor/off_tokens"] == 0 for r in rows)
  assert trainer.state.buffer.stats()["trajectories"] > 0
  retired = set(trainer.state.buffer.retired)
  assert retired and retired <= set(trainer.state.stream.state_dict()["retired"])
  assert all(r["experience/replay_solve_all"] == 0 for r in rows)


def test_replay_solve_all_is_the_share_of_replay_groups_solved_k_of_k(tmp_path):
  _, rows = run(tmp_path / "solved", steps=3, engine=SolvesReplaysEngine())
  assert [r["experience/replay_solve_all"] for r in rows] == [0.0, 1.0, 1.0]
  # The plain script answers a replayed question's fresh rows alternately.
  _, rows = run(tmp_path / "mixed", steps=3)
  assert [r["experience/replay_solve_all"] for r in rows] == [0.0, 0.0, 0.0]


COMPARED = ("batch/solved", "batch/replay_started", "actor/pg_loss", "actor/off_pg_loss",
            "actor/pg_clipfrac", "actor/grad_norm", "actor/entropy", "experience/stored",
            "experience/batch_size", "experience/trajectories", "experience/retired")


@pytest.mark.slow  # by default: kill_resume_test kills and resumes a run past the start
def test_resume_after_the_delayed_start_fired_mid_run(tmp_path):
  # The script's batch accuracy is 10/16 = 0.625 before any replay: the start fires
  # at the end of step 1, so step 1 only retires and clips, steps 2-4 do not clip and
  # collect, and steps 3-4 replay. A resumed run that lost the flag would differ.
  reference_trainer, reference = run(tmp_path / "reference", steps=4,
                                     algo__delayed_start=0.6)
  assert [r["batch/replay_started"] for r in reference] == [1, 1, 1, 1]
  assert reference[0]["experience/stored"] == 0
  assert reference[1]["experience/stored"] > 0
  assert reference[2]["experience/batch_size"] > 0
  run(tmp_path / "resumed", steps=1, algo__delayed_start=0.6)
  resumed_trainer, rows = run(tmp_path / "resumed", steps=4, algo__delayed_start=0.6)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  for step in (2, 3, 4):
    for key in COMPARED:
      np.testing.assert_allclose(rows[step - 1][key], reference[step - 1][key], rtol=1e-5,
                                 atol=1e-7, err_msg=f"step {step} {key}")
  for a, b in zip(jax.tree.leaves(resumed_trainer.state.params),
                  jax.tree.leaves(reference_trainer.state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_resume_honours_changed_replay_settings(exgrpo_run, tmp_path):
  del exgrpo_run  # run after the module's run, so the reward pool is not contended
  run(tmp_path, steps=1)
  trainer, _ = run(tmp_path, steps=2, replay__sigma=0.5, replay__max_total=3)
  assert trainer.state.buffer.config.sigma == 0.5
  assert trainer.state.buffer.config.max_total == 3
  assert trainer.state.buffer.stats()["trajectories"] <= 3
  with pytest.raises(config_check.ConfigError, match=r"config.rollout.k=8: the checkpoint"):
    run(tmp_path, steps=3, rollout__k=8)


def test_convert_exports_training_checkpoint(exgrpo_run, tmp_path):
  from exgrpo_jax import convert  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import models  # pylint: disable=g-import-not-at-top
  trainer, _ = exgrpo_run
  assert convert.main(["--src", trainer.workdir, "--dst", str(tmp_path)]) == 0
  exported = models.from_pretrained(str(tmp_path))
  for a, b in zip(jax.tree.leaves(exported.params), jax.tree.leaves(trainer.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert os.path.exists(tmp_path / "tokenizer.json")


def test_run_exports_final_policy(exgrpo_run):
  from exgrpo_jax import models  # pylint: disable=g-import-not-at-top
  trainer, _ = exgrpo_run
  exported = models.from_pretrained(os.path.join(trainer.workdir, "hf"))
  for a, b in zip(jax.tree.leaves(exported.params), jax.tree.leaves(trainer.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
