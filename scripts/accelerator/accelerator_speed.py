"""The speed parts of accelerator_check.py: sampler tokens/s and the learner step.

Registered in `accelerator_parts.PARTS`; shapes from `accelerator_parts.Sizes`. Run alone,
in aot_env.sh's GPU environment, it writes the AOT check's memory figures of the learner
cases for a GPU the check will run on (docs/results/aot_accelerator_learner.json):

  .aot/gpu/bin/python scripts/accelerator/accelerator_speed.py --predict h100x1

and sets a check's learner figures against them (Markdown; the table of
docs/accelerator_results.md):

  python scripts/accelerator/accelerator_speed.py \
      --compare docs/results/accelerator_check_h200.json
"""

import argparse
import importlib
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from exgrpo_jax import models
from exgrpo_jax import sharding
from exgrpo_jax.aot import targets
from exgrpo_jax.models import attention
from exgrpo_jax.training import learner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run as a script
  sys.path.insert(0, REPO)

from scripts.accelerator import accelerator_parts as parts  # pylint: disable=g-import-not-at-top,wrong-import-position
from scripts.bench import bench_attention_memory  # pylint: disable=g-import-not-at-top,wrong-import-position
from scripts.bench import bench_sampler  # pylint: disable=g-import-not-at-top,wrong-import-position

GIB = 2 ** 30
AOT_PREDICTIONS = os.path.join(REPO, "docs", "results", "aot_accelerator_learner.json")
# Dense bfloat16 peak (TFLOP/s, no sparsity) by device_kind substring, first match wins.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4),
                    ("H200", 989.4), ("A100", 312.0))


def _transformers_from_subject(subject: parts.Subject, device: str, dtype: str):
  torch, transformers = parts.import_torch()
  if subject.hf_dir:
    return transformers.AutoModelForCausalLM.from_pretrained(
        subject.hf_dir, dtype=getattr(torch, dtype)).to(device).eval()
  config = transformers.AutoConfig.for_model(**models.to_hf_config(subject.cfg))
  with torch.device(device):
    return transformers.AutoModelForCausalLM.from_config(
        config, dtype=getattr(torch, dtype)).eval()


@parts.PARTS.register("sampler")
def sampler(ctx: parts.Context, deadline: parts.Deadline) -> dict:
  """bfloat16 tokens/s (EOS ignored, T = 1) of our JAX sampler and transformers `generate`,
  and the HBM bound: (weight + KV bytes read per decode step) / the device's published
  bandwidth (`bench_sampler.bound_bandwidth_gbs`)."""
  sz = ctx.sizes
  bandwidths = bench_sampler.bound_bandwidth_gbs(max(sz.repeats, 5))
  bandwidth = bandwidths["bound_bandwidth_gb_per_s"]
  try:
    parts.import_torch()
    device, torch_skip = ctx.torch_device(), None
  except parts.Skip as e:
    device, torch_skip = None, str(e)
  runs, skipped = [], []
  hf_models = {}
  for batch in sz.sampler_batches:
    for name in ("smollm2", "qwen"):
      if deadline.passed():
        skipped.append(f"{name} batch {batch}")
        continue
      subject = ctx.subject(name)
      cfg = subject.cfg.replace(dtype="bfloat16")
      prompts = bench_sampler.chat_prompts(subject.tokenizer, batch)
      # Random weights sample ids beyond the (SmolLM2) tokenizer's vocabulary: no texts.
      ours = bench_sampler.bench_ours(cfg, subject.params,
                                      subject.tokenizer if subject.hf_dir else None, prompts,
                                      sz.sampler_new_tokens, sz.repeats)
      run = dict(model=subject.name, batch=batch, new_tokens=sz.sampler_new_tokens,
                 ours={k: ours[k] for k in ("tokens_per_s", "decode_tokens_per_s",
                                            "compile_s", "memory")})
      context = float(np.mean([len(p) for p in prompts])) + sz.sampler_new_tokens / 2
      bound = bench_sampler.roofline(cfg, batch, context, bandwidth, sz.repeats)
      run["hbm_bound_tokens_per_s"] = bound["bandwidth_bound_tokens_per_s"]
      run["decode_fraction_of_hbm_bound"] = (ours["decode_tokens_per_s"]
                                             / bound["bandwidth_bound_tokens_per_s"])
      if torch_skip:
        run["transformers"] = dict(skipped=torch_skip)
      else:
        if name not in hf_models:
          hf_models[name] = _transformers_from_subject(subject, device, "bfloat16")
        run["transformers"] = bench_sampler.time_generate(
            hf_models[name], subject.tokenizer.pad_token_id, prompts, sz.sampler_new_tokens,
            sz.repeats, device)
        run["ours_over_transformers"] = (ours["tokens_per_s"]
                                         / run["transformers"]["tokens_per_s"])
      runs.append(run)
      print(f"[accelerator_check] sampler: {subject.name} batch {batch}: "
            f"{ours['tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
  hf_models.clear()
  if device == "cuda":  # give PyTorch's cached blocks back before the learner's JAX steps
    import torch  # pylint: disable=g-import-not-at-top
    torch.cuda.empty_cache()
  return dict(dtype="bfloat16", **bandwidths, torch_device=device, runs=runs,
              skipped_for_budget=skipped,
              summary=", ".join(f"{r['model'].split()[0]} b{r['batch']} "
                                f"{r['ours']['tokens_per_s']:.0f} tok/s" for r in runs))


def _train_batch(S: int, M: int, vocab: int, rng: np.random.Generator) -> learner.TrainBatch:
  """M micro-batches of one packed row: a prompt of S/9 and a response of 8S/9 tokens."""
  abstract = bench_attention_memory.abstract_batch(S)
  P, R = S // 9, abstract.index_MxBxR.shape[-1]
  full = lambda x, value: jnp.full((M,) + x.shape[1:], value, x.dtype)
  return learner.TrainBatch(
      tokens_MxBxT=jnp.asarray(rng.integers(0, vocab, (M, 1, S)), jnp.int32),
      segment_ids_MxBxT=full(abstract.segment_ids_MxBxT, 1),
      index_MxBxR=jnp.broadcast_to(P - 1 + jnp.arange(R, dtype=jnp.int32), (M, 1, R)),
      mask_MxBxR=full(abstract.mask_MxBxR, True),
      old_logp_MxBxR=full(abstract.old_logp_MxBxR, -math.log(vocab)),
      adv_MxBxR=jnp.asarray(rng.choice([-1.0, 1.0], (M, 1, R)), jnp.float32),
      is_replay_MxBxR=full(abstract.is_replay_MxBxR, False),
      weight_MxBxR=full(abstract.weight_MxBxR, 1.0 / (M * R)))


def _peak_tflops() -> float | None:
  device = jax.devices()[0]
  if device.platform == "cpu":
    return None
  return next((t for key, t in PEAK_BF16_TFLOPS if key in device.device_kind), None)


def _lower(config, cfg, params, opt_state, batch):
  """The learner step of a case, lowered for these (real or abstract) arguments."""
  return learner.step_program(params, opt_state).lower(
      params, opt_state, batch, cfg=cfg, algo=learner.frozen(config.algo),
      optim=learner.frozen(config.optim), use_clip=True, chunk=config.train.logprob_chunk)


def predict(target: str, out: str) -> None:
  """The AOT check's memory figures for every learner case of the full check on one
  `target` device (run in scripts/accelerator/aot_env.sh's GPU environment); the check on that GPU
  sets its own against them (`aot_prediction`)."""
  from exgrpo_jax.aot import analysis  # pylint: disable=g-import-not-at-top
  targets.prepare_environment()
  device = targets.devices(targets.get(target))[0]
  mesh = jax.sharding.Mesh(np.array([device]), ("fsdp",))
  on_device = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device)), tree)
  config = importlib.import_module("configs.qwen1_5b").get_config()
  sz = parts.FULL
  cases = {}
  for impl in ("cudnn", "blockwise", "xla"):
    cfg = parts.qwen_shape().replace(dtype="bfloat16", param_dtype="float32", remat="full",
                                     attention=impl)
    params = on_device(models.abstract_params(cfg))
    opt_state = on_device(jax.eval_shape(learner.make_optimizer(config.optim).init, params))
    for S in sz.learner_lengths:
      batch = on_device(jax.eval_shape(lambda S=S: _train_batch(
          S, sz.learner_micro_batches, cfg.vocab_size, np.random.default_rng(0))))
      with sharding.use_mesh(mesh):  # attention resolves against the target's device
        m = _lower(config, cfg, params, opt_state, batch).compile().memory_analysis()
      cases[_case_key(impl, S, sz.learner_micro_batches)] = dict(
          peak_gib=analysis.peak_bytes(m) / GIB, temp_gib=m.temp_size_in_bytes / GIB,
          argument_gib=m.argument_size_in_bytes / GIB)
      print(f"[accelerator_speed] {target} {impl} S={S}: peak "
            f"{analysis.peak_bytes(m) / GIB:.2f} GiB", file=sys.stderr, flush=True)
  kinds = {}
  if os.path.exists(out):
    with open(out, encoding="utf-8") as f:
      kinds = json.load(f)
  kinds[device.device_kind] = dict(target=target, jax=jax.__version__, cases=cases)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(kinds, f, indent=1)
    f.write("\n")


def _case_key(impl: str, S: int, M: int) -> str:
  return f"{impl} S={S} M={M}"


def _prediction(impl: str, S: int, M: int) -> dict | None:
  """The AOT check's figures for this case on this device kind, if any were made."""
  if not os.path.exists(AOT_PREDICTIONS):
    return None
  with open(AOT_PREDICTIONS, encoding="utf-8") as f:
    kinds = json.load(f)
  return kinds.get(jax.devices()[0].device_kind, {}).get("cases", {}).get(
      _case_key(impl, S, M))


def _learner_case(config, cfg, S: int, M: int, steps: int) -> dict:
  params = models.init_params(cfg, jax.random.key(0))
  opt_state = learner.make_optimizer(config.optim).init(params)
  batch = _train_batch(S, M, cfg.vocab_size, np.random.default_rng(0))
  start = time.perf_counter()
  compiled = _lower(config, cfg, params, opt_state, batch).compile()
  compile_s = time.perf_counter() - start
  m = compiled.memory_analysis()
  times = []
  for i in range(steps + 1):  # the first call is a warm-up
    start = time.perf_counter()
    params, opt_state, metrics = compiled(params, opt_state, batch)
    jax.block_until_ready(metrics)
    if i:
      times.append(time.perf_counter() - start)
  step_s = float(np.median(times))
  tokens = M * S
  # Model FLOPs: 6 per parameter of the matmuls (the tied embedding is the LM head) plus
  # causal attention (forward 2 x H x Dh x S per token and layer, backward twice that).
  matmul_params = cfg.num_params() - (0 if cfg.tie_word_embeddings
                                      else cfg.vocab_size * cfg.hidden_size)
  flops = tokens * (6 * matmul_params + 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * S)
  peak = _peak_tflops()
  compiled_bytes = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                    - m.alias_size_in_bytes)
  predicted = _prediction(cfg.attention, S, M)
  device_peak = parts.device_peak_gib()
  del params, opt_state
  return dict(attention=cfg.attention, S=S, micro_batches=M, step_s=step_s,
              tokens_per_s=tokens / step_s, model_tflop_per_step=flops / 1e12,
              mfu=None if peak is None else flops / step_s / (peak * 1e12),
              compile_s=compile_s, skipped_steps=float(metrics["skipped"]),
              compiled_gib=dict(total=compiled_bytes / GIB, temp=m.temp_size_in_bytes / GIB,
                                arguments=m.argument_size_in_bytes / GIB),
              device_peak_gib_so_far=device_peak,
              aot_prediction=predicted,
              compiled_over_predicted=(None if predicted is None
                                       else compiled_bytes / GIB / predicted["peak_gib"]))


@parts.PARTS.register("learner")
def learner_step(ctx: parts.Context, deadline: parts.Deadline) -> dict:
  """Optimizer-step time, tokens/s and MFU of the Qwen2.5-1.5B shape (bfloat16 compute,
  float32 params and AdamW, remat full; configs/qwen1_5b.py's optimizer and log-prob
  chunk), per attention implementation and S, with XLA's memory analysis of the step
  against the AOT check's for the same program on this device kind (`predict`; one
  device, one sequence per micro-batch)."""
  sz = ctx.sizes
  config = importlib.import_module("configs.qwen1_5b").get_config()
  model_cfg = lambda: ctx.subject("qwen").cfg.replace(
      dtype="bfloat16", param_dtype="float32", remat="full",
      vocab_size=sz.learner_vocab or ctx.subject("qwen").cfg.vocab_size)
  # The fused kernels first (what `auto` picks), so a short budget measures them.
  implementations = sz.learner_attention or [n for n in reversed(attention.supported())
                                             if n != "auto"]
  cases, skipped = [], []
  for impl in implementations:
    for S in sz.learner_lengths:
      if deadline.passed():
        skipped.append(f"{impl} S={S}")
        continue
      try:
        cases.append(_learner_case(config, model_cfg().replace(attention=impl), S,
                                   sz.learner_micro_batches, sz.learner_steps))
      except Exception as e:  # pylint: disable=broad-except
        cases.append(dict(attention=impl, S=S, error=parts.describe(e)))
      print(f"[accelerator_check] learner: {json.dumps(cases[-1])}", file=sys.stderr,
            flush=True)
  ran = [c for c in cases if "error" not in c]
  return dict(model=ctx.subject("qwen").name if ran else None, dtype="bfloat16",
              param_dtype="float32",
              remat="full", peak_bf16_tflops=_peak_tflops(),
              mfu_definition="6 x matmul params + 6 x L x H x Dh x S (causal attention) "
                             "FLOPs per token over the dense bf16 peak",
              cases=cases, skipped_for_budget=skipped,
              failures=[f"{c['attention']} S={c['S']}: {c['error']}" for c in cases
                        if "error" in c],
              summary=", ".join(f"{c['attention']} S={c['S']} {c['step_s']:.2f}s"
                                for c in ran))


def compare(report_path: str) -> str:
  """A Markdown table of a check's learner cases against the AOT predictions for its
  device kind (AOT_PREDICTIONS as it is now, so a prediction made after the run counts)."""
  with open(report_path, encoding="utf-8") as f:
    report = json.load(f)
  with open(AOT_PREDICTIONS, encoding="utf-8") as f:
    predicted = json.load(f).get(report["environment"]["device_kind"], {})
  lines = [f"Device {report['environment']['device_kind']}, jax "
           f"{report['environment']['versions'].get('jax')}; AOT prediction: jax "
           f"{predicted.get('jax')}, target {predicted.get('target')}.", "",
           "| case | compiled on the device (GiB) | AOT prediction (GiB) | device / AOT | "
           "temp on the device | temp by AOT | device peak so far (GiB) |",
           "|---|---|---|---|---|---|---|"]
  for case in report["parts"]["learner"]["figures"]["cases"]:
    if "error" in case:
      continue
    key = _case_key(case["attention"], case["S"], case["micro_batches"])
    aot = predicted.get("cases", {}).get(key)
    got = case["compiled_gib"]
    lines.append(f"| {key} | {got['total']:.2f} | " + (
        f"{aot['peak_gib']:.2f} | {got['total'] / aot['peak_gib']:.3f} | {got['temp']:.2f} | "
        f"{aot['temp_gib']:.2f}" if aot else f"none | | {got['temp']:.2f} | ")
        + f" | {case['device_peak_gib_so_far']:.2f} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description="AOT predictions of the learner cases")
  mode = parser.add_mutually_exclusive_group(required=True)
  mode.add_argument("--predict", metavar="TARGET", help="write predictions, e.g. h100x1")
  mode.add_argument("--compare", metavar="JSON",
                    help="an accelerator_check JSON's learner cases against the predictions")
  parser.add_argument("--out", default=AOT_PREDICTIONS)
  args = parser.parse_args(argv)
  if args.compare:
    print(compare(args.compare))
  else:
    predict(args.predict, args.out)


if __name__ == "__main__":
  main()
