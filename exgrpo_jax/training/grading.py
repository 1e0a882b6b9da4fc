"""Rewards of a run: grading training groups (docs/algorithm.md §8) and validation (§14).

  grader = Grader(config)
  stats = grader.grade(groups)              # sets every group's rewards [K]
  metrics = grader.validate(engine, params, tokenizer)   # val/* metrics, eval.source

Verification runs in the reward pool's worker processes. Every process grades; process
0's rewards are used everywhere, so a timeout on one host cannot make the processes'
buffers diverge.
"""

import jax
import numpy as np

from exgrpo_jax import data
from exgrpo_jax import distributed
from exgrpo_jax import evaluation
from exgrpo_jax import rewards
from exgrpo_jax import sampling


class Grader:
  """The reward pool, and the validation questions (loaded on first use)."""

  def __init__(self, config):
    self.config = config
    self.pool = rewards.RewardPool(num_workers=config.reward.num_workers,
                                   timeout_s=config.reward.timeout_s,
                                   plugin_modules=rewards.load_plugins(config.reward.plugins))
    self._eval_questions = None
    self.eval_responses = []  # a few graded completions of the latest validation

  def grade(self, groups) -> dict:
    """Scores every response (a replayed one with its group); returns the pool's stats."""
    items = [rewards.RewardItem(r.text, g.prompt.question.ground_truth,
                                g.prompt.question.reward_name, g.prompt.think_gate)
             for g in groups for r in g.responses]
    rewards_N, stats = self.pool.score(items)
    rewards_N = np.asarray(distributed.from_primary(rewards_N))
    start = 0
    for g in groups:
      g.rewards = rewards_N[start:start + len(g.responses)]
      start += len(g.responses)
    return stats

  def eval_questions(self) -> list:
    """The validation questions (`eval.source`, loaded on first use); [] without any."""
    if self._eval_questions is None:
      self._eval_questions = (data.sources.load(self.config, "eval").questions
                              if data.sources.has_eval_data(self.config) else [])
    return self._eval_questions

  def validate(self, engine, params, tokenizer) -> dict:
    """Validation accuracy on `eval.source`, per data source and averaged (val/* metrics).

    avg@n at `eval.temperature` (val/avg_score); with `eval.greedy` and a temperature
    above 0, also greedy accuracy on the same questions (val/greedy_score). A few graded
    completions of the first pass (`eval.samples`) are kept in `eval_responses`.
    """
    cfg = self.config.eval
    if not self.eval_questions():
      return {}
    result = self._evaluate(engine, params, tokenizer, cfg.temperature, cfg.n,
                            keep_responses=cfg.samples > 0)
    self.eval_responses = result.get("responses", [])[:cfg.samples]
    metrics = {f"val/test_score/{src}": v["avg@k"] for src, v in result["per_source"].items()}
    metrics["val/avg_score"] = result["overall"]["avg@k"]
    metrics["val/response_length"] = result["overall"]["mean_response_length"]
    if cfg.greedy and cfg.temperature > 0:
      result = self._evaluate(engine, params, tokenizer, 0.0, 1, keep_responses=False)
      metrics.update({f"val/greedy_score/{src}": v["avg@k"]
                      for src, v in result["per_source"].items()})
      metrics["val/greedy_score"] = result["overall"]["avg@k"]
    return metrics

  def _evaluate(self, engine, params, tokenizer, temperature, n, keep_responses) -> dict:
    """One evaluation pass over the validation questions (`evaluation.evaluate`'s dict)."""
    config = self.config
    # Same template (system prompt included) and length limit as the training prompts.
    options = evaluation.EvalOptions(template=config.data.template, remove_system=False,
                                     max_prompt_tokens=config.data.max_prompt_tokens,
                                     n=n, keep_responses=keep_responses)
    return evaluation.evaluate(
        engine, params, tokenizer, self._eval_questions,
        sampling.SamplingConfig(temperature=temperature, greedy=temperature == 0,
                                max_new_tokens=config.eval.max_new_tokens),
        self.pool, jax.random.key(config.train.seed), options)

  def close(self) -> None:
    self.pool.close()
