"""The evaluation driver: render, generate with a rollout engine, grade, summarise.

  results = runner.evaluate(engine, params, tokenizer, questions,
                            sampling.SamplingConfig(temperature=0.6, max_new_tokens=M),
                            pool, key=jax.random.key(0))
  print(runner.format_table(results))

`engine` is anything with the `exgrpo_jax.sampling` interface
(`generate(prompt_ids, n, params, key, sampling_config)` returning prompt-major rows
with `texts`, `lengths_N`, `truncated_N`, `prompt_index_N`). `evaluate_prompts` does the
same for prompts already rendered (`render`), e.g. after sizing the token budget from
their lengths. Metrics are per data_source (see `metrics.summarize`); the overall line is
the unweighted mean over sources, as the paper's "Avg." columns. `results["rewards"]`
counts each reward's samples and exceptions, with the first exception's text.
"""

import collections
import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from exgrpo_jax import data
from exgrpo_jax import rewards
from exgrpo_jax.evaluation import metrics


@dataclasses.dataclass(frozen=True)
class EvalOptions:
  """How questions become prompts and how many samples each gets.

  Attributes:
    template: prompt template name (`data.TEMPLATES`).
    remove_system: drop the file's system messages (the reference's eval does).
    max_prompt_tokens: longer prompts are dropped and counted (0 = no limit).
    n: samples per row.
    batch_prompts: prompts per `engine.generate` call.
    keep_responses: include every response text in the results.
  """

  template: str = "chat"
  remove_system: bool = True
  max_prompt_tokens: int = 0
  n: int = 1
  batch_prompts: int = 64
  keep_responses: bool = False


@dataclasses.dataclass(frozen=True)
class _Sample:
  """One graded response."""

  prompt: data.Prompt
  text: str
  reward: float
  status: str
  length: int
  truncated: bool


def render(questions: Sequence[data.Question], tokenizer,
           options: EvalOptions) -> tuple[list[data.Prompt], int]:
  """(prompts, number dropped as longer than `options.max_prompt_tokens`)."""
  return data.render_prompts(questions, tokenizer, options.template,
                             options.max_prompt_tokens, options.remove_system)


def evaluate(engine, params, tokenizer, questions: Sequence[data.Question], sampling_config,
             pool: rewards.RewardPool, key: jax.Array, options: EvalOptions = EvalOptions(),
             log: Callable[[str], None] = lambda message: None) -> dict:
  """Renders, generates, grades and summarises; returns a JSON-friendly results dict."""
  prompts, dropped = render(questions, tokenizer, options)
  return evaluate_prompts(engine, params, prompts, dropped, sampling_config, pool, key,
                          options, log)


def evaluate_prompts(engine, params, prompts: Sequence[data.Prompt], dropped: int,
                     sampling_config, pool: rewards.RewardPool, key: jax.Array,
                     options: EvalOptions = EvalOptions(),
                     log: Callable[[str], None] = lambda message: None) -> dict:
  """`evaluate` for rendered prompts (`dropped`: how many `render` left out)."""
  # Similar lengths share a call, so less padding (the engine buckets prompt lengths).
  prompts = sorted(prompts, key=lambda p: len(p.ids))
  samples, reward_stats, by_reward = [], collections.Counter(), {}
  gen_s = grade_s = 0.0
  for call, start in enumerate(range(0, len(prompts), options.batch_prompts)):
    chunk = prompts[start:start + options.batch_prompts]
    t0 = time.perf_counter()
    out = engine.generate([list(p.ids) for p in chunk], options.n, params,
                          jax.random.fold_in(key, call), sampling_config)
    t1 = time.perf_counter()
    rows = [chunk[int(i)] for i in np.asarray(out.prompt_index_N)]
    scores = pool.grade(
        [rewards.RewardItem(text, p.question.ground_truth, p.question.reward_name,
                            p.think_gate) for text, p in zip(out.texts, rows)])
    gen_s, grade_s = gen_s + t1 - t0, grade_s + time.perf_counter() - t1
    reward_stats.update(scores.stats)
    for p, error in zip(rows, scores.error_N):
      counts = by_reward.setdefault(p.question.reward_name,
                                    dict(samples=0, exceptions=0, first_exception=""))
      counts["samples"] += 1
      if error:
        counts["exceptions"] += 1
        counts["first_exception"] = counts["first_exception"] or error
    samples += [_Sample(p, text, float(reward), str(status), int(length), bool(truncated))
                for p, text, reward, status, length, truncated in zip(
                    rows, out.texts, scores.rewards_N, scores.status_N, out.lengths_N,
                    out.truncated_N)]
    log(f"[eval] {start + len(chunk)}/{len(prompts)} prompts, generate {gen_s:.1f} s, "
        f"grade {grade_s:.1f} s")
  per_source = _summarize_by_source(samples)
  lengths = [s.length for s in samples] or [0]
  results = dict(
      per_source=per_source,
      overall={"sources": len(per_source), "samples": len(samples),
               "avg@k": float(np.mean([v["avg@k"] for v in per_source.values()] or np.nan)),
               "mean_response_length": float(np.mean(lengths))},
      dropped_prompts=dropped,
      reward_stats=dict(reward_stats),
      rewards=by_reward,
      timing=dict(generate_s=gen_s, grade_s=grade_s),
      options=dataclasses.asdict(options),
  )
  if options.keep_responses:
    results["responses"] = [
        dict(uid=s.prompt.question.uid, data_source=s.prompt.question.data_source,
             problem=s.prompt.question.problem, ground_truth=s.prompt.question.ground_truth,
             response=s.text, reward=s.reward,
             status=s.status) for s in samples]
  return results


def _summarize_by_source(samples: Sequence[_Sample]) -> dict[str, dict]:
  """`metrics.summarize` per data_source; identical prompts form one question."""
  group_of, by_source = {}, collections.defaultdict(list)
  for s in samples:
    q = s.prompt.question
    group = group_of.setdefault((q.data_source, s.prompt.text, q.ground_truth), len(group_of))
    by_source[q.data_source].append((group, s.reward > 0, s.length, s.truncated, s.status))
  return {source: metrics.summarize(*map(np.asarray, zip(*rows)))
          for source, rows in sorted(by_source.items())}


def format_table(results: dict) -> str:
  """A fixed-width table: one line per data_source, then the overall line.

  `exc` counts the samples whose reward raised (scored 0 whatever the response said).
  """
  header = (f"{'data_source':<18}{'questions':>10}{'k':>5}{'avg@k':>8}{'pass@k':>8}"
            f"{'mean len':>10}{'trunc':>8}{'no ans':>8}{'format':>8}{'exc':>7}")
  lines = [header, "-" * len(header)]
  for source, s in results["per_source"].items():
    top = s["pass@k"][str(s["k"])]
    lines.append(f"{source[:17]:<18}{s['questions']:>10}{s['k']:>5}{100 * s['avg@k']:>8.1f}"
                 f"{100 * top:>8.1f}{s['mean_response_length']:>10.1f}"
                 f"{100 * s['truncated_frac']:>7.1f}%{100 * s['no_answer_frac']:>7.1f}%"
                 f"{100 * s['format_frac']:>7.1f}%{s['exceptions']:>7}")
  lines.append("-" * len(header))
  overall = results["overall"]
  lines.append(f"{'average (' + str(overall['sources']) + ' sources)':<33}"
               f"{100 * overall['avg@k']:>8.1f}{'':>8}{overall['mean_response_length']:>10.1f}")
  if results["dropped_prompts"]:
    lines.append(f"({results['dropped_prompts']} prompts longer than the limit were dropped)")
  return "\n".join(lines)
