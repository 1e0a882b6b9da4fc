"""The reasoning_gym source: seeded, held-out split disjoint, graded by the dataset's own
verifier in the reward pool's worker processes; bad settings are one config line."""

import dataclasses
import importlib
import importlib.util
import json
import sys

import pytest

from exgrpo_jax import rewards
from exgrpo_jax.data import rgym
from exgrpo_jax.data import sources
from exgrpo_jax.rewards import gym
from exgrpo_jax.training import config_check

needs_gym = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                               reason="reasoning-gym is not installed (the test extra)")

SETTINGS = rgym.GymSettings(dataset="chain_sum", train_size=40, eval_size=20, seed=3)


@needs_gym
def test_same_settings_same_questions_and_seed_changes_them():
  first = rgym.make_questions(SETTINGS, "train")
  assert first == rgym.make_questions(SETTINGS, "train")
  other = rgym.make_questions(dataclasses.replace(SETTINGS, seed=4), "train")
  assert [q.problem for q in first] != [q.problem for q in other]
  assert [q.uid for q in first] == list(range(SETTINGS.train_size))
  assert rgym.make_questions(SETTINGS, "train", limit=5) == first[:5]
  assert all(q.problem.endswith(SETTINGS.instruction) for q in first)
  assert {(q.reward_name, q.data_source) for q in first} == {
      ("reasoning_gym", "reasoning_gym:chain_sum")}


@needs_gym
def test_splits_are_disjoint():
  # leg_counting's small problem space repeats questions: the train split must skip them.
  small = rgym.GymSettings(dataset="leg_counting", options='{"min_animals": 1, '
                           '"max_animals": 1, "max_instances": 2}', train_size=30, eval_size=10)
  for settings in (SETTINGS, small):
    train = rgym.make_questions(settings, "train")
    held_out = rgym.make_questions(settings, "eval")
    assert (len(train), len(held_out)) == (settings.train_size, settings.eval_size)
    assert not {q.problem for q in train} & {q.problem for q in held_out}
    assert not ({json.loads(q.ground_truth)["index"] for q in train}
                & {json.loads(q.ground_truth)["index"] for q in held_out})


@needs_gym
@pytest.mark.parametrize("dataset", ["chain_sum", "word_sorting"])
def test_reward_pool_scores_with_the_datasets_verifier(dataset):
  settings = dataclasses.replace(SETTINGS, dataset=dataset)
  questions = rgym.make_questions(settings, "eval", limit=4)
  responses = []
  for q in questions:
    answer = json.loads(q.ground_truth)["answer"]
    responses += [(q, f"Let me think.\n<answer>{answer}</answer>"),
                  (q, "<answer>not it</answer>"), (q, answer)]
  with rewards.RewardPool(num_workers=1) as pool:
    reward_N, status_N, _ = pool.score_with_status(
        [rewards.RewardItem(text, q.ground_truth, q.reward_name, False)
         for q, text in responses])
  assert list(reward_N) == [1.0, 0.0, 0.0] * len(questions)
  assert list(status_N) == ["ok", "ok", "no_answer"] * len(questions)


def _config(**settings):
  c = importlib.import_module("configs.tiny").get_config()
  c.data.source = c.eval.source = "reasoning_gym"
  c.data.reasoning_gym.update(settings)
  return c


@needs_gym
def test_config_sources_load_the_splits():
  c = _config(dataset="chain_sum", train_size=12, eval_size=6)
  config_check.check(c)
  train, held_out = sources.load(c, "train"), sources.load(c, "eval")
  assert (len(train.questions), len(held_out.questions)) == (12, 6)
  assert not {q.problem for q in train.questions} & {q.problem for q in held_out.questions}


@needs_gym
@pytest.mark.parametrize("settings, message", [
    (dict(dataset=""), "reasoning_gym dataset '' is unknown; known: "),
    (dict(dataset="chainsum"), "reasoning_gym dataset 'chainsum' is unknown"),
    (dict(dataset="chain_sum", options="{min_terms: 2"), "options '{min_terms: 2': not JSON"),
    (dict(dataset="chain_sum", options='{"digits": 2}'), "unexpected keyword argument 'digits'"),
    (dict(dataset="chain_sum", eval_size=0), "both must be positive"),
    (dict(dataset="leg_counting", train_size=100, options='{"min_animals": 1, '
          '"max_animals": 1, "max_instances": 1}'), "only "),
])
def test_bad_settings_are_one_config_line(settings, message):
  with pytest.raises(config_check.ConfigError) as e:
    config_check.check(_config(**settings))
  assert str(e.value).startswith("config.data.reasoning_gym={")
  assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_package_names_the_install_command(monkeypatch):
  monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if absent
  gym.dataset.cache_clear()
  with pytest.raises(config_check.ConfigError) as e:
    config_check.check(_config(dataset="chain_sum"))
  assert "reasoning_gym is not installed: pip install 'exgrpo_jax[reasoning_gym]'" in str(
      e.value)
  assert "\n" not in str(e.value)
