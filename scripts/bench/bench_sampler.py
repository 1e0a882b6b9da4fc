"""Rollout throughput: the JAX sampler against vLLM and transformers `generate`.

Shown in docs/sampler_performance.md; on a GPU, its functions measure the sampler part of
docs/accelerator_results.md.

  python scripts/bench/bench_sampler.py                    # embedded SmolLM2, batch 1, 8, 64
  python scripts/bench/bench_sampler.py --vllm --skip-transformers --new-tokens 64 --repeats 5
  python scripts/bench/bench_sampler.py --vllm --vllm-dtype bfloat16 --skip-transformers
  python scripts/bench/bench_sampler.py --batch-sizes 64 --new-tokens 64 --repeats 3
  python scripts/bench/bench_sampler.py --cache-phases --batch-sizes 8 --new-tokens 1024
  python scripts/bench/bench_sampler.py --schedulers --batch-sizes 8 --rows 32 --new-tokens 512
  python scripts/bench/bench_sampler.py --schedulers --batch-sizes 8 --rows 8 --new-tokens 256

Both samplers run in this process on the same chat prompts (GSM8K test questions,
`gsm8k_test.parquet` in the data directory where `python -m exgrpo_jax.prepare_data`
writes it, else short generated questions), sample at temperature 1 with no top-k/top-p,
and generate
exactly --new-tokens tokens per row (EOS ignored). Times are medians of --repeats calls
after a warm-up call, so compilation is excluded and reported on its own. Per batch size
the JSON has:

* tokens_per_s (end to end, prefill included) for ours and transformers, and their ratio
  (transformers needs PyTorch, which the plain install leaves out: without it the
  comparison is skipped with a note; `pip install "torch==2.13.0+cpu"` adds it on CPU);
* our decode-only rate, from the time difference of two response lengths;
* the roofline: decode FLOPs per step (matmuls + attention over the average context)
  divided by the matmul throughput measured on the model's own weight shapes at that
  batch size, and the memory-bandwidth bound (weight + KV bytes per step over the
  device's published bandwidth where known, else the measured read bandwidth:
  `bound_bandwidth_gbs`; weights and cache in the model's compute dtype), with our
  decode rate as a fraction of the roofline; since
  decode attention streams the KV cache (memory-bound, not in the FLOP count), also
  the bound of compute time plus the time to read the average context's KV once;
* the compiled program's device memory (XLA memory_analysis).

With --cache-phases it instead times our sampler with the KV cache at full size from the
first step (1 phase) against the default for that length (`decode.phases_for`: long
rollouts grow the cache in phases), calls alternating, in one process.

With --schedulers it instead runs a rollout as training does: --rows rows (--samples per
GSM8K chat prompt) at temperature 1 with natural EOS, in --batch-sizes slots, scheduled
statically (calls of at most that many rows, each decoded until its last row ends) and
continuously (a slot takes the next waiting row as soon as its row ends; with no more
--rows than slots the tail shrinks to the live rows, whatever --new-tokens), calls
alternating with the same key per pair, so both decode the same rows (the JSON counts the
rows that are identical: a draw of a very unlikely token can flip under the 1e-5 float
differences of another summation order, and the row then goes its own way).
It reports tokens/s (compile time excluded), the useful fraction (generated tokens /
slot-steps), decode steps, time per step (prefills and admissions included), the slots
a step decodes on average (below --batch-sizes when the continuous tail shrinks), the
cache slots a step reads per row on average (continuous: the page pool's slots over the
slots decoded), the continuous loop's host time and its slot-steps
left idle until the end of a chunk, and the load average around every call.

With --vllm (the default on a GPU) the vLLM engine runs too, started once in this
process (its worker lives here; `--vllm-dtype` sets its compute dtype, the model's by
default), on the same prompts after our sampler at each batch size, its calls taking
turns with ours (`ours_paired_tokens_per_s`): `ratio_vs_vllm` is the median of the
per-pair ratios of ours over vLLM's tokens/s, and its start-up time is reported. On an
NVIDIA GPU the transformers model runs on CUDA and the bandwidth bound uses the GPU's
published bandwidth. Other work on the machine skews every number (the JSON records the
load average before and after): run it on a quiet machine.
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from exgrpo_jax import generate
from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax.aot import targets
from exgrpo_jax.data import readers
from exgrpo_jax.sampling import decode
from exgrpo_jax.sampling import vllm_setup

DATA = "gsm8k_test.parquet"  # in the data directory (readers.default_dir())
MAX_PROMPT_TOKENS = 512  # vLLM's max_model_len is this plus --new-tokens
NO_TORCH = ('transformers comparison skipped: it needs PyTorch, which the plain install '
            'leaves out (pip install "torch==2.13.0+cpu" on CPU; --skip-transformers '
            'silences this)')
FALLBACK = ["What is {i} + 35?", "Name {i} animals that live in the sea.",
            "Explain in a few words why the sky is blue (take {i})."]


def log(message):
  print(f"[bench] {message}", file=sys.stderr, flush=True)


def chat_prompts(tokenizer, count):
  """`count` chat-formatted prompts: GSM8K test questions, else numbered fallbacks."""
  path = readers.resolve(DATA)
  if os.path.exists(path):
    import pandas as pd  # pylint: disable=g-import-not-at-top
    questions = pd.read_parquet(path)["question"].tolist()[:count]
  else:
    questions = [FALLBACK[i % len(FALLBACK)].format(i=i) for i in range(count)]
  return [generate.encode(tokenizer, q, chat=True) for q in questions]


def median_time(fn, repeats):
  """Median wall time of `repeats` calls of fn."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def bench_ours(cfg, params, tokenizer, prompts, new_tokens, repeats, engine=None,
               **engine_options):
  """End-to-end and decode-only tokens/s of the JAX engine (`engine`, or one made with
  `engine_options`; default: the static loop, at any length: rows that all run to
  new_tokens leave no tail to shrink), compile time, memory."""
  engine = engine or sampling.make_engine("jax", cfg, tokenizer, ignore_eos=True,
                                          **({"scheduler": "static"} | engine_options))
  short = max(new_tokens // 4, 1)
  times = {}
  for n in (new_tokens, short):
    config = sampling.SamplingConfig(max_new_tokens=n)
    run = lambda: engine.generate(prompts, 1, params, jax.random.key(0), config)  # pylint: disable=cell-var-from-loop
    out = run()  # warm-up: compiles
    assert (out.lengths_N == n).all()
    times[n] = median_time(run, repeats)
  B = len(prompts)
  step_s = (times[new_tokens] - times[short]) / (new_tokens - short)
  return dict(tokens_per_s=B * new_tokens / times[new_tokens], seconds=times[new_tokens],
              decode_tokens_per_s=B / step_s, decode_step_ms=1e3 * step_s,
              compile_s=engine.stats["compile_s"], compiles=engine.stats["compiles"],
              memory=engine.stats["memory"])


def bench_cache_phases(cfg, params, tokenizer, prompts, new_tokens, repeats):
  """tokens/s with the whole cache from the start vs the default phased cache."""
  phased = decode.phases_for(new_tokens)
  config = sampling.SamplingConfig(max_new_tokens=new_tokens)
  runs = {}
  for phases in (1, phased):
    engine = sampling.make_engine("jax", cfg, tokenizer, ignore_eos=True, cache_phases=phases,
                                  scheduler="static")
    run = lambda e=engine: e.generate(prompts, 1, params, jax.random.key(0), config)
    run()  # warm-up: compiles
    runs[phases] = (engine, run, [])
  for _ in range(repeats):  # alternate, so drifting load hits both alike
    for _, run, times in runs.values():
      start = time.perf_counter()
      run()
      times.append(time.perf_counter() - start)
  out = {f"phases_{p}": dict(tokens_per_s=len(prompts) * new_tokens / statistics.median(t),
                             seconds=statistics.median(t), compile_s=e.stats["compile_s"])
         for p, (e, _, t) in runs.items()}
  out["speedup"] = out[f"phases_{phased}"]["tokens_per_s"] / out["phases_1"]["tokens_per_s"]
  return out


def bench_schedulers(cfg, params, tokenizer, prompts, slots, samples, new_tokens, repeats):
  """Static against continuous scheduling in `slots` slots, natural EOS, T = 1."""
  config = sampling.SamplingConfig(max_new_tokens=new_tokens)
  engines = {name: sampling.make_engine("jax", cfg, tokenizer, max_rows=slots, scheduler=name,
                                        continuous_from=0)
             for name in ("static", "continuous")}
  calls = {name: [] for name in engines}
  for i in range(repeats):  # alternate, so drifting load hits both alike
    outs = {}
    for name, engine in engines.items():
      before, load = dict(engine.stats), os.getloadavg()[0]
      start = time.perf_counter()
      outs[name] = engine.generate(prompts, samples, params, jax.random.key(i), config)
      delta = {k: engine.stats[k] - before[k] for k in
               ("compile_s", "decode_steps", "slot_steps", "attended_slots", "new_tokens",
                "host_s", "chunk_idle_steps")}
      seconds = time.perf_counter() - start - delta["compile_s"]
      steps = delta["decode_steps"]
      calls[name].append(dict(delta, seconds=seconds, tokens_per_s=delta["new_tokens"] / seconds,
                              useful_fraction=delta["new_tokens"] / delta["slot_steps"],
                              steps=steps, ms_per_step=1000 * seconds / steps,
                              mean_slots=delta["slot_steps"] / steps,
                              mean_attended_slots=delta["attended_slots"] / steps,
                              load_before=load, load_after=os.getloadavg()[0]))
      log(f"{name} call {i}: {json.dumps(calls[name][-1])}")
    a, b = outs["static"], outs["continuous"]
    same_N = (a.tokens_NxT == b.tokens_NxT).all(1)
    calls["continuous"][-1].update(rows_identical_to_static=int(same_N.sum()),
                                   max_logprob_diff_identical_rows=float(np.abs(
                                       a.logprobs_NxT - b.logprobs_NxT)[same_N].max()))
    calls["static"][-1].update(mean_length=float(a.lengths_N.mean()),
                               eos_fraction=float(1 - a.truncated_N.mean()))
  result = {name: dict(calls=c, **{k: statistics.median(x[k] for x in c) for k in
                                   ("tokens_per_s", "useful_fraction", "seconds", "steps",
                                    "ms_per_step", "mean_slots", "mean_attended_slots")},
                       compile_s=engines[name].stats["compile_s"],
                       compiles=engines[name].stats["compiles"])
            for name, c in calls.items()}
  result["speedup"] = statistics.median(
      c["tokens_per_s"] / s["tokens_per_s"] for s, c in zip(calls["static"],
                                                             calls["continuous"]))
  return result


def bench_transformers(hf_dir, tokenizer, prompts, new_tokens, repeats, device,
                       dtype="float32"):
  """tokens/s of transformers `generate` on the model in `hf_dir` (see `time_generate`)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  model = transformers.AutoModelForCausalLM.from_pretrained(
      hf_dir, dtype=getattr(torch, dtype)).to(device).eval()
  return time_generate(model, tokenizer.pad_token_id, prompts, new_tokens, repeats, device)


def time_generate(model, pad_id, prompts, new_tokens, repeats, device):
  """tokens/s of transformers `generate` (left-padded batch, sampling at T = 1)."""
  import torch  # pylint: disable=g-import-not-at-top
  width = max(map(len, prompts))
  ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

  def run():
    with torch.no_grad():
      out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                           top_p=1.0, min_new_tokens=new_tokens, max_new_tokens=new_tokens,
                           pad_token_id=pad_id)
    assert out.shape[1] == width + new_tokens
    if device != "cpu":
      torch.cuda.synchronize()

  run()
  seconds = median_time(run, repeats)
  return dict(tokens_per_s=len(prompts) * new_tokens / seconds, seconds=seconds,
              torch_threads=torch.get_num_threads())


def start_vllm(cfg, tokenizer, dtype, max_batch, new_tokens):
  """(the vLLM engine, its start-up seconds), or (None, why it could not start)."""
  start = time.perf_counter()
  try:
    engine = sampling.make_engine(
        "vllm", cfg, tokenizer, ignore_eos=True, options=vllm_setup.VllmOptions(
            max_model_len=MAX_PROMPT_TOKENS + new_tokens, max_num_seqs=max_batch,
            sleep_level=0, dtype=dtype))
  except (ImportError, RuntimeError) as e:
    return None, str(e)
  return engine, time.perf_counter() - start


def bench_vllm(engine, ours, params, prompts, new_tokens, repeats):
  """tokens/s of the vLLM engine, its calls taking turns with those of ours (the JAX
  engine `ours`, already compiled for these prompts): the machine's drift, which moved
  vLLM's batch-8 speed by 20% between runs on a 2-core VM, then hits both alike.
  `ratio` is the median of the per-pair ratios ours / vLLM."""
  config = sampling.SamplingConfig(max_new_tokens=new_tokens)
  runs = [lambda e=e: e.generate(prompts, 1, params, jax.random.key(0), config)
          for e in (ours, engine)]
  runs[1]()  # warm-up
  pairs = [[median_time(run, 1) for run in runs] for _ in range(repeats)]
  tokens = len(prompts) * new_tokens
  ours_s, vllm_s = (statistics.median(t) for t in zip(*pairs))
  return dict(tokens_per_s=tokens / vllm_s, seconds=vllm_s,
              ours_paired_tokens_per_s=tokens / ours_s,
              ratio=statistics.median(v / o for o, v in pairs))


def roofline(cfg, batch, context, bandwidth_gbs, repeats):
  """Decode-step bounds at `batch` rows attending to `context` tokens on average.

  The matmul throughput is measured on a chain with the model's weight shapes and data
  dependencies (q, k, v from x; o; gate, up; down; per layer, then the LM head), i.e. a
  decode step with attention, norms and sampling removed, in the compute dtype (the
  sampler's rollout copy of the weights and its KV cache are in it too).
  """
  dtype = models.config.dtype_from_name(cfg.dtype)
  itemsize = np.dtype(dtype).itemsize
  D, V = cfg.hidden_size, cfg.vocab_size
  HD, KD = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  layer = _layer_shapes(cfg)
  # Drawn on the device: a 1.5B-parameter model's weights take minutes from a host RNG.
  keys = iter(jax.random.split(jax.random.key(0), cfg.num_layers * len(layer) + 1))
  normal = lambda shape: 0.02 * jax.random.normal(next(keys), shape, dtype)
  weights = [{n: normal(s) for n, s in layer.items()} for _ in range(cfg.num_layers)]
  head = normal((D, V))

  @jax.jit
  def matmuls(x_BxD, weights, head):
    for w in weights:
      q, k, v = x_BxD @ w["q"], x_BxD @ w["k"], x_BxD @ w["v"]
      x_BxD = x_BxD + (q + jnp.tile(k + v, HD // KD)) @ w["o"]
      x_BxD = x_BxD + jnp.tanh(x_BxD @ w["gate"]) * (x_BxD @ w["up"]) @ w["down"]
    return x_BxD @ head

  x = jnp.ones((batch, D), dtype)
  jax.block_until_ready(matmuls(x, weights, head))
  seconds = median_time(lambda: jax.block_until_ready(matmuls(x, weights, head)), repeats)
  matmul_flops = 2 * batch * _weight_count(cfg)
  attention_flops = 4 * batch * cfg.num_layers * HD * context
  step_flops = matmul_flops + attention_flops
  throughput = matmul_flops / seconds
  kv_bytes = itemsize * 2 * cfg.num_layers * batch * KD * context
  compute_s, kv_s = step_flops / throughput, kv_bytes / (bandwidth_gbs * 1e9)
  return dict(step_gflop=step_flops / 1e9, matmul_gflops_per_s=throughput / 1e9,
              roofline_tokens_per_s=batch / compute_s,
              bandwidth_bound_tokens_per_s=bandwidth_bound(cfg, batch, context,
                                                           bandwidth_gbs),
              compute_plus_kv_read_tokens_per_s=batch / (compute_s + kv_s))


def _layer_shapes(cfg) -> dict:
  """A decoder layer's weight matrices (in, out)."""
  D, F = cfg.hidden_size, cfg.intermediate_size
  HD, KD = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return dict(q=(D, HD), k=(D, KD), v=(D, KD), o=(HD, D), gate=(D, F), up=(D, F),
              down=(F, D))


def _weight_count(cfg) -> int:
  """The matmul weights a decode step reads: every layer's and the LM head."""
  return (cfg.num_layers * sum(a * b for a, b in _layer_shapes(cfg).values())
          + cfg.hidden_size * cfg.vocab_size)


def bandwidth_bound(cfg, batch, context, bandwidth_gbs) -> float:
  """Decode tokens/s if a step only read the weights and `batch` rows' KV of `context`
  tokens, in the compute dtype, at `bandwidth_gbs`."""
  itemsize = np.dtype(models.config.dtype_from_name(cfg.dtype)).itemsize
  kv_bytes = itemsize * 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * context
  return batch * bandwidth_gbs * 1e9 / (itemsize * _weight_count(cfg) + kv_bytes)


def bound_bandwidth_gbs(repeats) -> dict:
  """The bandwidth decode bounds divide by (`bound_...`): the device's published figure
  where the AOT targets know the device (a sum to one scalar read 539 GB/s on an H200,
  published at 4,800), else the measured read bandwidth; both beside it."""
  measured = read_bandwidth_gbs(repeats)
  published = {t.device_kind: t.hbm_bandwidth / 1e9
               for t in targets.TARGETS.values()}.get(jax.devices()[0].device_kind)
  return dict(measured_read_bandwidth_gb_per_s=measured,
              published_bandwidth_gb_per_s=published,
              bound_bandwidth_gb_per_s=published or measured)


def read_bandwidth_gbs(repeats):
  """Device read bandwidth (GB/s): the time to sum a 512 MiB array's rows (a sum to one
  scalar ran at 539 GB/s on an H200)."""
  big = jnp.ones((4096, 32 * 2**10), jnp.float32)  # 512 MiB
  total = jax.jit(lambda x: x.sum(axis=1))
  jax.block_until_ready(total(big))
  return big.nbytes / median_time(lambda: jax.block_until_ready(total(big)), repeats) / 1e9


def main(argv=None):
  """Parses flags, runs every batch size, prints the JSON."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="", help="HF dir or .gguf (default: embedded SmolLM2)")
  p.add_argument("--batch-sizes", default="1,8,64")
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--skip-transformers", action="store_true")
  p.add_argument("--vllm", action="store_true", help="also time vLLM (default on a GPU)")
  p.add_argument("--vllm-dtype", default="",
                 help="vLLM's compute dtype, rollout.vllm.dtype (default: the model's)")
  p.add_argument("--cache-phases", action="store_true",
                 help="only compare the full-size cache with the phased one")
  p.add_argument("--schedulers", action="store_true",
                 help="only compare static and continuous scheduling (natural EOS)")
  p.add_argument("--rows", type=int, default=32, help="--schedulers: rows per rollout")
  p.add_argument("--samples", type=int, default=4, help="--schedulers: rows per prompt")
  args = p.parse_args(argv)
  compare = not (args.skip_transformers or args.schedulers or args.cache_phases)
  if compare and importlib.util.find_spec("torch") is None:
    log(NO_TORCH)
    compare = False
  policy = models.from_pretrained(args.model or None)
  tokenizer = models.load_tokenizer(args.model or None)
  hf_dir = models.resolve_hf_dir(args.model or models.default_model_path())
  gpu = jax.devices()[0].platform == "gpu"
  bandwidths = bound_bandwidth_gbs(args.repeats)
  result = dict(model=args.model or "SmolLM2-135M-Instruct (embedded)",
                device=str(jax.devices()[0].device_kind), cpu_count=os.cpu_count(),
                load_average_at_start=os.getloadavg(),
                new_tokens=args.new_tokens, dtype=policy.config.dtype,
                **bandwidths, runs=[])
  batches = [int(b) for b in args.batch_sizes.split(",")]
  vllm_engine = None
  if (args.vllm or gpu) and not (args.schedulers or args.cache_phases):
    log("starting vLLM")
    vllm_engine, started = start_vllm(policy.config, tokenizer, args.vllm_dtype,
                                      max(batches), args.new_tokens)
    result["vllm"] = (dict(skipped=started) if vllm_engine is None else dict(
        dtype=vllm_engine.model_cfg.dtype, start_s=started, platform=vllm_engine.platform))
  for batch in batches:
    prompts = chat_prompts(tokenizer, batch)
    if args.schedulers:
      prompts = chat_prompts(tokenizer, -(-args.rows // args.samples))
    run = dict(batch=batch, mean_prompt_tokens=float(np.mean([len(q) for q in prompts])))
    if args.schedulers:
      log(f"{batch} slots: static and continuous scheduling")
      run.update(rows=len(prompts) * args.samples, samples_per_prompt=args.samples,
                 schedulers=bench_schedulers(policy.config, policy.params, tokenizer, prompts,
                                             batch, args.samples, args.new_tokens,
                                             args.repeats))
      result["runs"].append(run)
      log(json.dumps(run))
      continue
    if args.cache_phases:
      log(f"batch {batch}: cache phases")
      run["cache_phases"] = bench_cache_phases(policy.config, policy.params, tokenizer,
                                               prompts, args.new_tokens, args.repeats)
      result["runs"].append(run)
      log(json.dumps(run))
      continue
    log(f"batch {batch}: ours")
    ours = sampling.make_engine("jax", policy.config, tokenizer, ignore_eos=True,
                                scheduler="static")
    run["ours"] = bench_ours(policy.config, policy.params, tokenizer, prompts,
                             args.new_tokens, args.repeats, engine=ours)
    if not compare:
      run["transformers"] = dict(skipped="--skip-transformers" if args.skip_transformers
                                 else "PyTorch is not installed")
    else:
      log(f"batch {batch}: transformers")
      run["transformers"] = bench_transformers(hf_dir, tokenizer, prompts, args.new_tokens,
                                               args.repeats, "cuda" if gpu else "cpu")
      run["ratio_vs_transformers"] = (run["ours"]["tokens_per_s"]
                                      / run["transformers"]["tokens_per_s"])
    if vllm_engine is not None:
      log(f"batch {batch}: vllm, its calls taking turns with ours")
      run["vllm"] = bench_vllm(vllm_engine, ours, policy.params, prompts, args.new_tokens,
                               args.repeats)
      run["ratio_vs_vllm"] = run["vllm"].pop("ratio")
    context = run["mean_prompt_tokens"] + args.new_tokens / 2
    run["roofline"] = roofline(policy.config, batch, context,
                               bandwidths["bound_bandwidth_gb_per_s"], args.repeats)
    run["decode_fraction_of_roofline"] = (run["ours"]["decode_tokens_per_s"]
                                          / run["roofline"]["roofline_tokens_per_s"])
    run["decode_fraction_of_compute_plus_kv_read"] = (
        run["ours"]["decode_tokens_per_s"]
        / run["roofline"]["compute_plus_kv_read_tokens_per_s"])
    result["runs"].append(run)
    log(json.dumps(run))
  result["load_average_at_end"] = os.getloadavg()
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
