"""Samples completions for prompts given on the command line and prints them.

  python -m exgrpo_jax.generate --prompt "What is 12 + 35?" --chat --temperature 0.6
  python -m exgrpo_jax.generate --model PATH --prompt "Once upon a time" --n 4 \\
      --temperature 0.8 --top-p 0.95 --max-new-tokens 128 --seed 0

PATH is an HF directory, a .gguf file or an exgrpo_jax training checkpoint; without
--model the embedded SmolLM2-135M-Instruct is used. The default --temperature 1 samples
the model's full distribution, where a model this small soon wanders off the question;
0.6 (the paper's evaluation temperature) or 0 (greedy) keeps it on it. --chat wraps
each prompt as a user message in the tokenizer's chat template. --max-rows N decodes at
most N rows at once (the others wait for a free slot: continuous batching). Completions
go to stdout, progress and timing (compile time separately) to stderr.
"""

import argparse
import sys
import time

import jax

from exgrpo_jax import cli
from exgrpo_jax import compile_cache
from exgrpo_jax import eval as eval_cli
from exgrpo_jax import models
from exgrpo_jax import sampling


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m exgrpo_jax.generate",
                              description=__doc__.split("\n\n")[0])
  add = p.add_argument
  add("--model", default="", help="HF dir, .gguf, or training checkpoint (default: SmolLM2)")
  add("--prompt", action="append", required=True, help="a prompt (repeatable)")
  add("--chat", action="store_true", help="apply the tokenizer's chat template")
  add("--n", type=cli.positive_int, default=1, help="samples per prompt")
  add("--temperature", type=float, default=1.0, help="0 = greedy")
  add("--top-p", "--top_p", dest="top_p", type=float, default=1.0)
  add("--top-k", "--top_k", dest="top_k", type=int, default=0, help="0 = off")
  add("--max-new-tokens", "--max_new_tokens", dest="max_new_tokens", type=int, default=128)
  add("--stop", action="append", default=[], help="a stop string (repeatable)")
  add("--seed", type=int, default=0)
  add("--dtype", default="float32", choices=("float32", "bfloat16"))
  add("--engine", default="jax", choices=sampling.ENGINES.names())
  eval_cli.add_max_rows_flag(p)
  add("--compile-cache", "--compile_cache", dest="compile_cache",
      action=argparse.BooleanOptionalAction, default=True,
      help="reuse compiled programs across calls (exgrpo_jax.compile_cache)")
  cli.add_debug_flag(p)
  return p


def encode(tokenizer, prompt: str, chat: bool) -> list[int]:
  """Token ids of `prompt`, as a chat user turn (with the assistant header) if `chat`."""
  if chat:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
  return list(tokenizer(prompt)["input_ids"])


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  compile_cache.enable(args.compile_cache)
  return cli.guarded(lambda: eval_cli.at_matmul_precision(args.dtype, lambda: _generate(args)),
                     debug=args.debug)


def _generate(args) -> int:
  start = time.perf_counter()
  config = sampling.SamplingConfig(
      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
      max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop))
  cfg, params, tokenizer = eval_cli.load_model(args.model, args.dtype)
  engine = eval_cli.make_engine(args, cfg, tokenizer)
  eval_cli.log(f"[generate] model {args.model or models.default_model_path()} loaded in "
               f"{time.perf_counter() - start:.1f} s")
  prompt_ids = [encode(tokenizer, p, args.chat) for p in args.prompt]
  longest = max(len(ids) for ids in prompt_ids)
  if longest + args.max_new_tokens > cfg.max_position_embeddings:
    return cli.error(f"a {longest}-token prompt plus --max-new-tokens {args.max_new_tokens} "
                     f"exceeds the model's {cfg.max_position_embeddings} positions")
  start = time.perf_counter()
  out = engine.generate(prompt_ids, args.n, params, jax.random.key(args.seed), config)
  elapsed = time.perf_counter() - start
  compile_s = getattr(engine, "stats", {}).get("compile_s", 0.0)
  tokens = int(out.lengths_N.sum())
  eval_cli.log(f"[generate] {tokens} tokens in {elapsed:.1f} s (compile {compile_s:.1f} s, "
               f"{tokens / max(elapsed - compile_s, 1e-9):.1f} tokens/s after compile)")
  for row, text in enumerate(out.texts):
    i = int(out.prompt_index_N[row])
    end = "max tokens" if out.truncated_N[row] else "end"
    print(f"=== prompt {i}, sample {row - int((out.prompt_index_N < i).sum())} "
          f"({int(out.lengths_N[row])} tokens, {end}) ===")
    print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
