"""Evaluates a model on benchmark files and prints a table per data_source.

  python -m exgrpo_jax.eval --data arithmetic --limit 10   # embedded SmolLM2, on CPU
  python -m exgrpo_jax.eval --model PATH --data exgrpo_test_id.parquet \\
      --data ood_arc_c.parquet --out results.json
  python -m exgrpo_jax.eval --data arithmetic --reward-module my_rewards --reward last_int

A relative --data path is read from the working directory where it exists there, else from
the data directory that `python -m exgrpo_jax.prepare_data` fills (docs/data.md, "Data"),
as training's `data.train_path` is.

PATH is an HF directory, a .gguf file, or an exgrpo_jax training workdir / checkpoint
step directory; without --model the embedded SmolLM2-135M-Instruct is used. Defaults
follow the reference's evaluation: temperature 0.6, top-p 1.0, n = 1, the model's chat
template with the file's system prompt removed. --limit N keeps the first N rows of
every data_source, so each benchmark still appears.

The token budget (--max-new-tokens, default 0 = the task's) is the task's own: 8192 for
data files (the reference's eval), 48 for the generated arithmetic (its answer is a number;
the CPU config's eval.max_new_tokens), the larger one when both are given; it is cut to the
positions the model has left after the longest prompt, and the line before generation says
which. A budget given on the command line is kept, and prompts that do not fit beside it
are dropped and counted.

--reward-module imports reward plugins (docs/rewards.md) in this process and in every
reward worker, as `config.reward.plugins` does for training; --reward then names any
registered reward. A reward that raises on every one of its samples ends the run with exit
status 1 and one line naming it (after the table and the JSON); the table's `exc` column
counts exceptions.
"""

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp

from exgrpo_jax import checkpointing
from exgrpo_jax import cli
from exgrpo_jax import compile_cache
from exgrpo_jax import data
from exgrpo_jax import models
from exgrpo_jax import rewards
from exgrpo_jax import sampling
from exgrpo_jax.evaluation import runner


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m exgrpo_jax.eval",
                              description=__doc__.split("\n\n")[0])
  add = p.add_argument
  add("--model", default="", help="HF dir, .gguf, or training workdir (default: SmolLM2)")
  add("--data", action="append", required=True,
      help="a data file (repeatable), or arithmetic[:FIELD=VALUE;...]: the held-out "
      "split of the generated task (exgrpo_jax.data.arithmetic settings)")
  add("--limit", type=cli.non_negative_int, default=0, help="first N rows of every data_source (0 = all)")
  add("--sources", default="", help="comma-separated data_sources to keep (default: all)")
  add("--template", default="chat", choices=data.TEMPLATES.names())
  add("--reward", default="",
      help="reward for every row (default: by data_source); built in: "
      + ", ".join(rewards.REWARDS.names()) + ", or one a --reward-module registers")
  add("--reward-module", "--reward_module", dest="reward_module", action="append",
      default=[], help="module that registers reward plugins (repeatable; docs/rewards.md)")
  add("--remove-system", "--remove_system", dest="remove_system",
      action=argparse.BooleanOptionalAction, default=True,
      help="drop the file's system prompt (the reference's eval does)")
  add("--temperature", type=float, default=0.6)
  add("--top-p", "--top_p", dest="top_p", type=float, default=1.0)
  add("--max-new-tokens", "--max_new_tokens", dest="max_new_tokens", type=cli.non_negative_int,
      default=0, help="response tokens (0 = the task's budget, within the model's context)")
  add("--max-prompt-tokens", "--max_prompt_tokens", dest="max_prompt_tokens",
      type=cli.non_negative_int,
      default=0, help="drop (and count) longer prompts (0 = no limit)")
  add("--n", type=cli.positive_int, default=1, help="samples per row")
  add("--batch-prompts", "--batch_prompts", dest="batch_prompts", type=cli.positive_int,
      default=64)
  add_max_rows_flag(p)
  add("--seed", type=int, default=0)
  add("--dtype", default="float32", choices=("float32", "bfloat16"))
  add("--engine", default="jax", choices=sampling.ENGINES.names())
  add("--compile-cache", "--compile_cache", dest="compile_cache",
      action=argparse.BooleanOptionalAction, default=True,
      help="reuse compiled programs across calls (exgrpo_jax.compile_cache)")
  add("--reward-workers", "--reward_workers", dest="reward_workers", type=int, default=2)
  add("--reward-timeout", "--reward_timeout", dest="reward_timeout", type=float, default=10.0)
  add("--save-responses", "--save_responses", dest="save_responses", action="store_true",
      help="include every response in the JSON")
  add("--out", default="", help="write the results JSON here")
  cli.add_debug_flag(p)
  return p


def add_max_rows_flag(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
      "--max-rows", "--max_rows", dest="max_rows", type=cli.non_negative_int, default=0,
      help="jax engine: rows decoded at once; a call's other rows wait for a free slot "
           "(continuous batching). 0 = all rows of a call")


def make_engine(args, cfg, tokenizer):
  """The `--engine` rollout engine; the jax engine decodes `--max-rows` rows at once."""
  if args.max_rows and args.engine != "jax":
    print(f"[exgrpo_jax] warning: --max-rows={args.max_rows} is the JAX sampler's; the "
          f"{args.engine} engine ignores it", file=sys.stderr, flush=True)
  return sampling.make_engine(args.engine, cfg, tokenizer, **(
      {"max_rows": args.max_rows or None} if args.engine == "jax" else {}))


def load_model(path: str, dtype: str):
  """(ModelConfig, params, tokenizer) from an HF dir, .gguf, training checkpoint or ""."""
  if path and checkpointing.is_training_checkpoint(path):
    cfg, params, tokenizer_source = checkpointing.load_policy_for_export(path)
    cfg = dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype)
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    return cfg, params, models.load_tokenizer(tokenizer_source or None)
  policy = models.from_pretrained(path or None, dtype=dtype)
  return policy.config, policy.params, models.load_tokenizer(path or None)


def select(questions: list[data.Question], limit: int, sources: str) -> list[data.Question]:
  """The first `limit` rows of each data_source, restricted to `sources` if given."""
  wanted = {s for s in sources.split(",") if s}
  counts, kept = {}, []
  for q in questions:
    if wanted and q.data_source not in wanted:
      continue
    counts[q.data_source] = counts.get(q.data_source, 0) + 1
    if not limit or counts[q.data_source] <= limit:
      kept.append(q)
  return kept


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  compile_cache.enable(args.compile_cache)
  return cli.guarded(lambda: at_matmul_precision(args.dtype, lambda: _evaluate(args)),
                     debug=args.debug)


def at_matmul_precision(dtype: str, fn):
  """`fn()` at the matmul precision a training run uses for `dtype` ("auto")."""
  with jax.default_matmul_precision(models.matmul_precision("auto", dtype)):
    return fn()


# Token budgets of the tasks (--max-new-tokens 0): data files get the reference eval's
# (generate_vllm.py's max_tokens; configs/common.py eval.max_new_tokens), the generated
# arithmetic the CPU config's (configs/smollm2_135m.py eval.max_new_tokens): its answers
# are a number.
FILE_MAX_NEW_TOKENS = 8192
ARITHMETIC_MAX_NEW_TOKENS = 48


def _load(args) -> tuple[list[data.Question], int]:
  """The selected questions of every --data, and the largest of their tasks' budgets."""
  questions, task_budget = [], 0
  for path in args.data:
    if path.split(":")[0] == "arithmetic":  # the generated task's held-out split
      settings = data.arithmetic.ArithmeticSettings.parse(path.partition(":")[2])
      loaded = data.LoadResult(path, [
          dataclasses.replace(q, reward_name=args.reward or q.reward_name)
          for q in data.arithmetic.make_questions(settings, "eval")], [])
      task_budget = max(task_budget, ARITHMETIC_MAX_NEW_TOKENS)
    else:
      loaded = data.load_questions(path, reward_name=args.reward)
      task_budget = max(task_budget, FILE_MAX_NEW_TOKENS)
    for message in loaded.skipped:
      log(f"[eval] skipped {message}")
    questions += select(loaded.questions, args.limit, args.sources)
  if not questions:
    raise ValueError(f"no questions selected from {args.data} (sources={args.sources!r})")
  return questions, task_budget


def _evaluate(args) -> int:
  if args.out:
    cli.check_writable(args.out)  # before the long part, not after it
  plugins = rewards.load_plugins(args.reward_module)
  if args.reward and args.reward not in rewards.REWARDS:
    raise ValueError(f"--reward {args.reward!r} is not a registered reward; known: "
                     f"{', '.join(rewards.REWARDS.names())} (a plugin's rewards need its "
                     "--reward-module)")
  questions, task_budget = _load(args)
  start = time.perf_counter()
  cfg, params, tokenizer = load_model(args.model, args.dtype)
  log(f"[eval] model {args.model or models.default_model_path()} loaded in "
      f"{time.perf_counter() - start:.1f} s; {len(questions)} rows")
  context = cfg.max_position_embeddings
  if args.max_new_tokens >= context:
    return cli.error(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in "
                     f"the model's {context} positions")
  # A prompt needs one position left for its response.
  room = context - (args.max_new_tokens or 1)
  options = runner.EvalOptions(template=args.template, remove_system=args.remove_system,
                               max_prompt_tokens=min(args.max_prompt_tokens or room, room),
                               n=args.n, batch_prompts=args.batch_prompts,
                               keep_responses=args.save_responses)
  prompts, dropped = runner.render(questions, tokenizer, options)
  if not prompts:
    return cli.error(f"all {dropped} prompts are longer than the {options.max_prompt_tokens} "
                     "prompt tokens allowed (--max-prompt-tokens, and the model's "
                     f"{context} positions minus --max-new-tokens): nothing was evaluated")
  longest = max(len(p.ids) for p in prompts)
  budget = args.max_new_tokens or min(task_budget, context - longest)
  if not args.max_new_tokens:
    log(f"[eval] up to {budget} new tokens: " + (
        "the task's budget" if budget == task_budget else
        f"the task's {task_budget} cut to the model's {context} positions less the longest "
        f"prompt ({longest} tokens)") + "; --max-new-tokens sets it")
  engine = make_engine(args, cfg, tokenizer)
  sampling_config = sampling.SamplingConfig(temperature=args.temperature, top_p=args.top_p,
                                            max_new_tokens=budget)
  with rewards.RewardPool(args.reward_workers, args.reward_timeout, plugin_modules=plugins,
                          log_errors=False) as pool:
    results = runner.evaluate_prompts(engine, params, prompts, dropped, sampling_config, pool,
                                      jax.random.key(args.seed), options, log)
  results["config"] = dict(vars(args), model=args.model or models.default_model_path(),
                           max_new_tokens=budget)
  print(runner.format_table(results))
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=2)
    log(f"[eval] wrote {args.out}")
  return _report_reward_exceptions(results["rewards"])


def _report_reward_exceptions(by_reward: dict) -> int:
  """A line per reward that raised; exit status 1 when one raised on all its samples."""
  status = 0
  for name, counts in sorted(by_reward.items()):
    if counts["exceptions"] == counts["samples"]:
      status = cli.error(f"reward {name!r} raised on all {counts['samples']} samples "
                         f"(first: {counts['first_exception']}): nothing was scored")
    elif counts["exceptions"]:
      log(f"[eval] reward {name!r} raised on {counts['exceptions']} of {counts['samples']} "
          f"samples, scored 0 (first: {counts['first_exception']})")
  return status


if __name__ == "__main__":
  sys.exit(main())
