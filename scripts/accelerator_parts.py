"""The parts of scripts/accelerator_check.py: each takes (Context, Deadline), returns figures.

A part stops starting new measurements once its deadline has passed and lists what it
left out under "skipped_for_budget". `figures["failures"]` (non-empty) marks a check that
ran and missed its stated tolerance; `Skip` marks a part whose requirements are missing.
Shapes come from `Sizes`: FULL for an accelerator, SMOKE for a quick CPU run.
"""

import dataclasses
import importlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import numpy as np

from exgrpo_jax import cli
from exgrpo_jax import models
from exgrpo_jax import registry
from exgrpo_jax import sampling
from exgrpo_jax import sharding
from exgrpo_jax.models import attention
from exgrpo_jax.training import actor as actor_lib
from exgrpo_jax.training import learner
from exgrpo_jax.training import trainer as trainer_lib
from scripts import bench_attention_memory
from scripts import bench_sampler
from scripts import memory_plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2 ** 30
PARTS = registry.Registry("accelerator check part")
# Dense bfloat16 peak (TFLOP/s, no sparsity) by device_kind substring, first match wins.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4),
                    ("H200", 989.4), ("A100", 312.0))


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Every shape and count the parts use."""

  parity_rows: int = 2
  parity_tokens: int = 128
  sampler_batches: tuple = (1, 64, 256)
  sampler_new_tokens: int = 128
  repeats: int = 2
  learner_lengths: tuple = (4096, 9216)
  learner_attention: tuple | None = None  # None: every implementation the backend runs
  learner_vocab: int | None = None  # None: the model's
  learner_micro_batches: int = 2
  learner_steps: int = 3
  gap_prompts: int = 16
  gap_samples: int = 4
  gap_new_tokens: int = 256
  train_config: str = "smollm2_135m"
  train_max_steps: int = 10_000


FULL = Sizes()
SMOKE = Sizes(parity_tokens=32, sampler_batches=(2,), sampler_new_tokens=4, repeats=1,
              learner_lengths=(64,), learner_attention=("blockwise",), learner_vocab=512,
              learner_micro_batches=1, learner_steps=1, gap_prompts=2, gap_samples=2,
              gap_new_tokens=8, train_config="tiny", train_max_steps=1)


class Skip(Exception):
  """The part cannot run here (a missing package); the message says why."""


class Deadline:
  def __init__(self, seconds: float):
    self.end = time.monotonic() + seconds

  def left(self) -> float:
    return self.end - time.monotonic()

  def passed(self) -> bool:
    return self.left() <= 0


@dataclasses.dataclass
class Subject:
  """A model the parts measure: config (float32 params), params, tokenizer, HF dir."""

  name: str
  cfg: models.ModelConfig
  params: object
  tokenizer: object
  hf_dir: str | None  # None: random weights, for timing only


@dataclasses.dataclass
class Context:
  smoke: bool
  tests: tuple[str, ...]
  workdir: str
  subjects: dict = dataclasses.field(default_factory=dict)

  @property
  def sizes(self) -> Sizes:
    return SMOKE if self.smoke else FULL

  def torch_device(self) -> str:
    import torch  # pylint: disable=g-import-not-at-top
    return "cuda" if torch.cuda.is_available() and not self.smoke else "cpu"

  def subject(self, name: str) -> Subject:
    if name not in self.subjects:
      self.subjects[name] = (_smoke_subject if self.smoke else _subject)(name, self.workdir)
    return self.subjects[name]


def _subject(name: str, workdir: str) -> Subject:
  del workdir
  tokenizer = models.load_tokenizer()
  if name == "smollm2":
    policy = models.from_pretrained()
    return Subject("SmolLM2-135M-Instruct", policy.config, policy.params, tokenizer,
                   models.resolve_hf_dir(models.default_model_path()))
  _, hf = memory_plan.HF_CONFIGS["Qwen2.5-Math-1.5B"]
  cfg = models.from_hf_config(dict(hf, max_position_embeddings=16384),
                              pad_token_id=tokenizer.pad_token_id)
  return Subject("Qwen2.5-1.5B shape (random)", cfg,
                 models.init_params(cfg, jax.random.key(0)), tokenizer, None)


def _smoke_subject(name: str, workdir: str) -> Subject:
  """Tiny random llama (exported with SmolLM2's tokenizer) and qwen2 stand-ins."""
  tokenizer = models.load_tokenizer()
  cfg = models.ModelConfig(
      model_type="llama" if name == "smollm2" else "qwen2", vocab_size=len(tokenizer),
      hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
      head_dim=8, attention_bias=name != "smollm2", eos_token_id=(tokenizer.eos_token_id,),
      pad_token_id=tokenizer.pad_token_id)
  params = models.init_params(cfg, jax.random.key(0))
  hf_dir = None
  if name == "smollm2":
    hf_dir = models.save_pretrained(cfg, params, os.path.join(workdir, "tiny_llama"),
                                    tokenizer_src=models.default_model_path())
  return Subject(f"tiny random {cfg.model_type}", cfg, params, tokenizer, hf_dir)


def _import_torch():
  missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
  if missing:
    raise Skip(f"{' and '.join(missing)} not installed (pip install -e '.[test]')")
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  return torch, transformers


# --- 1. the test suite --------------------------------------------------------------------


@PARTS.register("tests")
def tests(ctx: Context, deadline: Deadline) -> dict:
  """pytest in a subprocess on this backend; at the deadline it is interrupted (SIGINT:
  pytest still writes its junit XML) and the tests that ran are reported."""
  xml_path = os.path.join(ctx.workdir, "tests.xml")
  command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             f"--junitxml={xml_path}", "--ignore=tests/accelerator_check_test.py", *ctx.tests]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  with open(os.path.join(ctx.workdir, "tests.log"), "w") as log:
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    interrupted = False
    try:
      proc.wait(timeout=max(deadline.left(), 1))
    except subprocess.TimeoutExpired:
      interrupted = True
      os.killpg(proc.pid, signal.SIGINT)
      try:
        proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
  if not os.path.exists(xml_path):
    raise RuntimeError(f"pytest wrote no junit XML (exit {proc.returncode}); "
                       f"see {log.name}")
  counts = dict(passed=0, failed=0, errors=0, skipped=0)
  failures = []
  for case in ET.parse(xml_path).getroot().iter("testcase"):
    test_id = f"{case.get('classname')}::{case.get('name')}"
    outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), None)
    if outcome in ("failure", "error"):
      message = (case.find(outcome).get("message") or "").strip().splitlines()
      failures.append(f"{test_id}: {message[0][:200] if message else outcome}")
    counts[{"failure": "failed", "error": "errors", "skipped": "skipped",
            None: "passed"}[outcome]] += 1
  return dict(command=" ".join(command[1:]), exit_status=proc.returncode,
              interrupted_at_budget=interrupted, **counts, failures=failures,
              summary=f"{counts['passed']} passed, {counts['failed']} failed, "
                      f"{counts['errors']} errors, {counts['skipped']} skipped"
                      + (" (budget: interrupted)" if interrupted else ""))


# --- 2. parity against transformers -------------------------------------------------------


def _text_ids(tokenizer, rows: int, length: int) -> np.ndarray:
  stream = sum(bench_sampler.chat_prompts(tokenizer, 64), [])
  while len(stream) < rows * length:
    stream += stream
  return np.array(stream[:rows * length], np.int32).reshape(rows, length)


@PARTS.register("parity")
def parity(ctx: Context, deadline: Deadline) -> dict:
  """Our logits/log-probs against transformers' on the same device and tokens.

  float32 (default and highest matmul precision): max |delta log p| <= 1e-3 (the CPU
  bound of tests/models_test.py). bfloat16: our error against transformers' float32
  within 4x transformers' own bfloat16 error (the bound of test_bf16_within_stated_tolerance).
  """
  torch, transformers = _import_torch()
  subject, sz, device = ctx.subject("smollm2"), ctx.sizes, ctx.torch_device()
  ids = _text_ids(subject.tokenizer, sz.parity_rows, sz.parity_tokens)

  def torch_logits(dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        subject.hf_dir, dtype=dtype).to(device).eval()
    with torch.no_grad():
      return model(torch.tensor(ids, device=device)).logits.float().cpu().numpy()

  ref_logits = torch_logits(torch.float32)
  ref_logp = np.asarray(jax.nn.log_softmax(ref_logits))
  torch_bf16_err = np.abs(np.asarray(jax.nn.log_softmax(torch_logits(torch.bfloat16)))
                          - ref_logp).max()
  rows, failures = [], []
  for dtype, precision in (("float32", "default"), ("float32", "highest"),
                           ("bfloat16", "default")):
    if deadline.passed():
      failures.append(f"{dtype}/{precision}: not run (budget)")
      continue
    policy = models.from_pretrained(subject.hf_dir, dtype=dtype, param_dtype="float32")
    with jax.default_matmul_precision(precision):
      logits = np.asarray(models.apply(policy.config, policy.params, jnp.asarray(ids))[0])
    logp = np.asarray(jax.nn.log_softmax(logits))
    err = np.abs(logp - ref_logp)
    tolerance = 1e-3 if dtype == "float32" else 4 * float(torch_bf16_err)
    row = dict(dtype=dtype, matmul_precision=precision,
               max_abs_logit_diff=float(np.abs(logits - ref_logits).max()),
               mean_abs_logit_diff=float(np.abs(logits - ref_logits).mean()),
               max_abs_logp_diff=float(err.max()), mean_abs_logp_diff=float(err.mean()),
               tolerance_max_abs_logp=tolerance, within_tolerance=bool(err.max() <= tolerance))
    rows.append(row)
    if not row["within_tolerance"]:
      failures.append(f"{dtype}/{precision}: max |delta log p| {err.max():.3g} > {tolerance:.3g}")
  return dict(model=subject.name, tokens=list(ids.shape), torch_device=device,
              torch_bf16_max_abs_logp_diff=float(torch_bf16_err), rows=rows, failures=failures,
              summary="; ".join(f"{r['dtype']}/{r['matmul_precision']} max|dlogp| "
                                f"{r['max_abs_logp_diff']:.2g}" for r in rows))


# --- 3. sampler throughput ----------------------------------------------------------------


def _transformers_from_subject(subject: Subject, device: str, dtype: str):
  torch, transformers = _import_torch()
  if subject.hf_dir:
    return transformers.AutoModelForCausalLM.from_pretrained(
        subject.hf_dir, dtype=getattr(torch, dtype)).to(device).eval()
  config = transformers.AutoConfig.for_model(**models.to_hf_config(subject.cfg))
  with torch.device(device):
    return transformers.AutoModelForCausalLM.from_config(
        config, dtype=getattr(torch, dtype)).eval()


@PARTS.register("sampler")
def sampler(ctx: Context, deadline: Deadline) -> dict:
  """bfloat16 tokens/s (EOS ignored, T = 1) of our JAX sampler and transformers `generate`,
  and the HBM bound: (weight + KV bytes read per decode step) / measured read bandwidth."""
  sz = ctx.sizes
  bandwidth = bench_sampler.read_bandwidth_gbs(sz.repeats)
  try:
    _import_torch()
    device, torch_skip = ctx.torch_device(), None
  except Skip as e:
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
      ours = bench_sampler.bench_ours(cfg, subject.params, subject.tokenizer, prompts,
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
  return dict(dtype="bfloat16", measured_read_bandwidth_gb_per_s=bandwidth,
              torch_device=device, runs=runs, skipped_for_budget=skipped,
              summary=", ".join(f"{r['model'].split()[0]} b{r['batch']} "
                                f"{r['ours']['tokens_per_s']:.0f} tok/s" for r in runs))


# --- 4. the learner step ------------------------------------------------------------------


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


def _device_peak_gib() -> float | None:
  stats = jax.devices()[0].memory_stats() or {}
  return round(stats["peak_bytes_in_use"] / GIB, 2) if "peak_bytes_in_use" in stats else None


def _learner_case(config, cfg, S: int, M: int, steps: int) -> dict:
  params = models.init_params(cfg, jax.random.key(0))
  opt_state = learner.make_optimizer(config.optim).init(params)
  batch = _train_batch(S, M, cfg.vocab_size, np.random.default_rng(0))
  flat, treedef = jax.tree.flatten(sharding.shardings_of((params, opt_state)))
  start = time.perf_counter()
  compiled = learner._compiled_step(treedef, tuple(flat)).lower(  # pylint: disable=protected-access
      params, opt_state, batch, cfg=cfg, algo=learner.frozen(config.algo),
      optim=learner.frozen(config.optim), use_clip=True,
      chunk=config.train.logprob_chunk).compile()
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
  mesh = jax.sharding.AbstractMesh((1, 1), ("fsdp", "tensor"))
  plan_bytes = (6 * memory_plan.shard_bytes(cfg, mesh, sharding.LEARNER_RULES, cfg.param_dtype)
                + memory_plan.activation_bytes(cfg, 1, S, 1, cfg.remat,
                                               config.train.logprob_chunk,
                                               gpu=jax.default_backend() == "gpu"))
  compiled_bytes = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                    - m.alias_size_in_bytes)
  del params, opt_state
  return dict(attention=cfg.attention, S=S, micro_batches=M, step_s=step_s,
              tokens_per_s=tokens / step_s, model_tflop_per_step=flops / 1e12,
              mfu=None if peak is None else flops / step_s / (peak * 1e12),
              compile_s=compile_s, skipped_steps=float(metrics["skipped"]),
              compiled_gib=dict(total=round(compiled_bytes / GIB, 2),
                                temp=round(m.temp_size_in_bytes / GIB, 2),
                                arguments=round(m.argument_size_in_bytes / GIB, 2)),
              device_peak_gib_so_far=_device_peak_gib(),
              memory_plan_learner_peak_gib=round(plan_bytes / GIB, 2))


@PARTS.register("learner")
def learner_step(ctx: Context, deadline: Deadline) -> dict:
  """Optimizer-step time, tokens/s and MFU of the Qwen2.5-1.5B shape (bfloat16 compute,
  float32 params and AdamW, remat full; configs/qwen1_5b.py's optimizer and log-prob
  chunk), per attention implementation and S, with XLA's memory analysis of the step
  against scripts/memory_plan.py's learner peak (one device, one sequence per micro-batch)."""
  sz = ctx.sizes
  config = importlib.import_module("configs.qwen1_5b").get_config()
  base = ctx.subject("qwen").cfg.replace(dtype="bfloat16", param_dtype="float32",
                                         remat="full")
  base = base.replace(vocab_size=sz.learner_vocab or base.vocab_size)
  implementations = sz.learner_attention or [n for n in attention.supported() if n != "auto"]
  cases, skipped = [], []
  for S in sz.learner_lengths:
    for impl in implementations:
      if deadline.passed():
        skipped.append(f"{impl} S={S}")
        continue
      try:
        cases.append(_learner_case(config, base.replace(attention=impl), S,
                                   sz.learner_micro_batches, sz.learner_steps))
      except Exception as e:  # pylint: disable=broad-except
        cases.append(dict(attention=impl, S=S, error=describe(e)))
      print(f"[accelerator_check] learner: {json.dumps(cases[-1])}", file=sys.stderr,
            flush=True)
  ran = [c for c in cases if "error" not in c]
  return dict(model=ctx.subject("qwen").name, dtype="bfloat16", param_dtype="float32",
              remat="full", peak_bf16_tflops=_peak_tflops(),
              mfu_definition="6 x matmul params + 6 x L x H x Dh x S (causal attention) "
                             "FLOPs per token over the dense bf16 peak",
              cases=cases, skipped_for_budget=skipped,
              failures=[f"{c['attention']} S={c['S']}: {c['error']}" for c in cases
                        if "error" in c],
              summary=", ".join(f"{c['attention']} S={c['S']} {c['step_s']:.2f}s"
                                for c in ran))


# --- 5. sampler against learner log-probs in bfloat16 -------------------------------------


@PARTS.register("gap")
def logprob_gap(ctx: Context, deadline: Deadline) -> dict:
  """|sampler log p - learner log p| on the sampler's own tokens (T = 1): the learner's is
  `Actor.score`, what the trainer recomputes pi_old with. Per compute dtype."""
  del deadline  # two short measurements
  sz, subject = ctx.sizes, ctx.subject("smollm2")
  config = importlib.import_module(f"configs.{sz.train_config}").get_config()
  config.rollout.max_new_tokens = sz.gap_new_tokens
  prompts = bench_sampler.chat_prompts(subject.tokenizer, sz.gap_prompts)
  rows = []
  for dtype in ("float32", "bfloat16"):
    cfg = subject.cfg.replace(dtype=dtype)
    engine = sampling.make_engine("jax", cfg, subject.tokenizer)
    out = engine.generate(prompts, sz.gap_samples, subject.params, jax.random.key(0),
                          sampling.SamplingConfig(max_new_tokens=sz.gap_new_tokens))
    responses = [out.tokens_NxT[i, :n] for i, n in enumerate(out.lengths_N)]
    actor = actor_lib.Actor(config, cfg, subject.tokenizer.pad_token_id)
    learner_logp = actor.score(subject.params, [(prompts[p], r) for p, r in
                                                zip(out.prompt_index_N, responses)])
    delta = np.concatenate([out.logprobs_NxT[i, :len(lp)] - lp
                            for i, lp in enumerate(learner_logp)])
    rows.append(dict(dtype=dtype, tokens=int(delta.size),
                     mean_abs_delta_logp=float(np.abs(delta).mean()),
                     max_abs_delta_logp=float(np.abs(delta).max()),
                     fraction_ratio_off_by_1pct=float(np.mean(np.abs(np.expm1(delta)) > 0.01))))
  return dict(model=subject.name, rows=rows,
              summary="; ".join(f"{r['dtype']} mean|dlogp| {r['mean_abs_delta_logp']:.2g}, "
                                f"{100 * r['fraction_ratio_off_by_1pct']:.1f}% off >1%"
                                for r in rows))


# --- 6. a training run --------------------------------------------------------------------


@PARTS.register("train")
def train(ctx: Context, deadline: Deadline) -> dict:
  """ExGRPO steps of the config's run (its own dtype and sizes) until the deadline."""
  sz = ctx.sizes
  config = importlib.import_module(f"configs.{sz.train_config}").get_config()
  config.train.steps = sz.train_max_steps
  config.train.checkpoint_every = sz.train_max_steps + 1
  config.train.export_dir = ""
  config.eval.every = 0
  config.eval.before_train = False
  start = time.perf_counter()
  trainer = trainer_lib.Trainer(config, os.path.join(ctx.workdir, "train"))
  setup_s = time.perf_counter() - start
  steps = []
  try:
    while len(steps) < sz.train_max_steps and not deadline.passed():
      metrics = trainer.train_step()
      steps.append({k: float(metrics[k]) for k in (
          "batch/solved", "batch/fresh_solved", "experience/batch_size",
          "response_length/mean", "actor/loss", "timing_s/step")})
  finally:
    trainer.close()
  solved = [s["batch/solved"] for s in steps]
  return dict(config=f"configs/{sz.train_config}.py", dtype=config.model.dtype,
              batch_questions=config.train.batch_questions, k=config.rollout.k,
              setup_s=setup_s, steps=steps,
              summary=f"{len(steps)} steps, solved {solved[0]:.2f} -> {solved[-1]:.2f}"
                      if steps else "no step finished")


def describe(e: BaseException) -> str:
  """`e` on one line, with its type (an XLA error's type says out-of-memory or not)."""
  text, name = cli.one_line(e)[:300], type(e).__name__
  return text if text.startswith(name) else f"{name}: {text}"
