"""The parts of accelerator_check.py: each takes (Context, Deadline), returns figures.

Here: the registry, sizes and models the parts share, and the tests, parity, gap and
train parts; the sampler and learner parts are in accelerator_speed.py. Their figures
are shown in docs/accelerator_results.md.

A part stops starting new measurements once its deadline has passed and lists what it
left out under "skipped_for_budget". `figures["failures"]` (non-empty) marks a check that
ran and missed its stated tolerance; `Skip` marks a part whose requirements are missing.
Shapes come from `Sizes`: FULL for an accelerator, SMOKE for a quick CPU run.
"""

import dataclasses
import functools
import importlib
import importlib.util
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
from exgrpo_jax.models import published
from exgrpo_jax.training import actor as actor_lib
from exgrpo_jax.training import trainer as trainer_lib
from scripts.bench import bench_sampler

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARTS = registry.Registry("accelerator check part")


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
  tests: tuple[str, ...]  # pytest arguments
  tests_log: str  # pytest's output, kept beside the JSON
  workdir: str  # temporary
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
  cfg = qwen_shape(tokenizer.pad_token_id)
  return Subject("Qwen2.5-1.5B shape (random)", cfg,
                 models.init_params(cfg, jax.random.key(0)), tokenizer, None)


def qwen_shape(pad_token_id: int | None = None) -> models.ModelConfig:
  """The check's Qwen2.5-Math-1.5B-shaped model, its context widened to 16k tokens."""
  hf = published.HF_CONFIGS["Qwen2.5-Math-1.5B"]
  return models.from_hf_config(dict(hf, max_position_embeddings=16384),
                               pad_token_id=pad_token_id)


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


def device_peak_gib() -> float | None:
  """The most memory the device has held so far (GiB); None where the backend does not
  count it (the CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats["peak_bytes_in_use"] / 2 ** 30 if "peak_bytes_in_use" in stats else None


def import_torch():
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
  with open(ctx.tests_log, "w") as log:
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
  with open(ctx.tests_log) as log:
    tail = log.read().splitlines()[-15:]
  if not os.path.exists(xml_path):
    raise RuntimeError(f"pytest wrote no junit XML (exit {proc.returncode}): "
                       f"{tail[-1] if tail else 'no output'} ({ctx.tests_log})")
  counts = dict(passed=0, failed=0, errors=0, skipped=0)
  failures, per_file = [], {}  # per_file: which files ran, when the budget cut the run
  for case in ET.parse(xml_path).getroot().iter("testcase"):
    test_id = f"{case.get('classname')}::{case.get('name')}"
    outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), None)
    if outcome in ("failure", "error"):
      message = (case.find(outcome).get("message") or "").strip().splitlines()
      failures.append(f"{test_id}: {message[0][:200] if message else outcome}")
    kind = {"failure": "failed", "error": "errors", "skipped": "skipped",
            None: "passed"}[outcome]
    counts[kind] += 1
    file_counts = per_file.setdefault(case.get("classname"), {})
    file_counts[kind] = file_counts.get(kind, 0) + 1
  return dict(command=" ".join(command[1:]), exit_status=proc.returncode,
              interrupted_at_budget=interrupted, **counts, failures=failures,
              per_file=dict(sorted(per_file.items())),
              log=ctx.tests_log, log_tail=tail,
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
  """Our logits/log-probs against transformers' on the same device and tokens, at the
  matmul precision a run uses for the dtype (`models.matmul_precision`, "auto").

  float32: max |delta log p| <= 1e-3 (the CPU bound of tests/models_test.py). bfloat16:
  our error against transformers' float32 within 4x transformers' own bfloat16 error (the
  bound of test_bf16_within_stated_tolerance). float32 at JAX's default precision is
  reported, not checked.
  """
  torch, transformers = import_torch()
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
  rows, failures, skipped = [], [], []
  # The precisions a run uses (model.matmul_precision "auto"), checked; and JAX's own
  # default for float32 (TF32 on NVIDIA GPUs), reported only: what "auto" avoids.
  for dtype, precision, checked in (
      ("float32", models.matmul_precision("auto", "float32"), True),
      ("bfloat16", models.matmul_precision("auto", "bfloat16"), True),
      ("float32", "default", False)):
    if deadline.passed():
      skipped.append(f"{dtype}/{precision}")
      continue
    policy = models.from_pretrained(subject.hf_dir, dtype=dtype, param_dtype="float32")
    with jax.default_matmul_precision(precision):  # a fresh jit: traced under it
      forward = jax.jit(functools.partial(models.apply, policy.config))
      logits = np.asarray(forward(policy.params, jnp.asarray(ids))[0])
    logp = np.asarray(jax.nn.log_softmax(logits))
    err = np.abs(logp - ref_logp)
    # The sequence's own next tokens: the log-probs a policy-gradient loss uses.
    take = lambda x: np.take_along_axis(x[:, :-1], ids[:, 1:, None], axis=-1)
    target_err = np.abs(take(logp) - take(ref_logp))
    tolerance = 1e-3 if dtype == "float32" else 4 * float(torch_bf16_err)
    row = dict(dtype=dtype, matmul_precision=precision,
               max_abs_logit_diff=float(np.abs(logits - ref_logits).max()),
               mean_abs_logit_diff=float(np.abs(logits - ref_logits).mean()),
               max_abs_logp_diff=float(err.max()), mean_abs_logp_diff=float(err.mean()),
               max_abs_next_token_logp_diff=float(target_err.max()),
               mean_abs_next_token_logp_diff=float(target_err.mean()),
               tolerance_max_abs_logp=tolerance if checked else None,
               within_tolerance=bool(err.max() <= tolerance) if checked else None)
    rows.append(row)
    if checked and not row["within_tolerance"]:
      failures.append(f"{dtype}/{precision}: max |delta log p| {err.max():.3g} > {tolerance:.3g}")
  return dict(model=subject.name, tokens=list(ids.shape), torch_device=device,
              torch_bf16_max_abs_logp_diff=float(torch_bf16_err), rows=rows, failures=failures,
              skipped_for_budget=skipped,
              summary="; ".join(f"{r['dtype']}/{r['matmul_precision']} max|dlogp| "
                                f"{r['max_abs_logp_diff']:.2g}" for r in rows))


# --- 3. sampler against learner log-probs in bfloat16 -------------------------------------


@PARTS.register("gap")
def logprob_gap(ctx: Context, deadline: Deadline) -> dict:
  """|sampler log p - learner log p| on the sampler's own tokens (T = 1): the learner's is
  `Actor.score`, what the trainer recomputes pi_old with. Per compute dtype, at the
  trainer's matmul precision for it."""
  del deadline  # two short measurements
  sz, subject = ctx.sizes, ctx.subject("smollm2")
  config = importlib.import_module(f"configs.{sz.train_config}").get_config()
  config.rollout.max_new_tokens = sz.gap_new_tokens
  prompts = bench_sampler.chat_prompts(subject.tokenizer, sz.gap_prompts)
  rows = []
  for dtype in ("float32", "bfloat16"):
    cfg = subject.cfg.replace(dtype=dtype)
    precision = models.matmul_precision("auto", dtype)  # the trainer's
    engine = sampling.make_engine("jax", cfg, subject.tokenizer)
    with jax.default_matmul_precision(precision):
      out = engine.generate(prompts, sz.gap_samples, subject.params, jax.random.key(0),
                            sampling.SamplingConfig(max_new_tokens=sz.gap_new_tokens))
      responses = [out.tokens_NxT[i, :n] for i, n in enumerate(out.lengths_N)]
      actor = actor_lib.Actor(config, cfg, subject.tokenizer.pad_token_id)
      learner_logp, _ = actor.score(subject.params, [(prompts[p], r) for p, r in
                                                     zip(out.prompt_index_N, responses)])
    delta = np.concatenate([out.logprobs_NxT[i, :len(lp)] - lp
                            for i, lp in enumerate(learner_logp)])
    rows.append(dict(dtype=dtype, matmul_precision=precision, tokens=int(delta.size),
                     mean_abs_delta_logp=float(np.abs(delta).mean()),
                     max_abs_delta_logp=float(np.abs(delta).max()),
                     fraction_ratio_off_by_1pct=float(np.mean(np.abs(np.expm1(delta)) > 0.01))))
  return dict(model=subject.name, rows=rows,
              summary="; ".join(f"{r['dtype']} mean|dlogp| {r['mean_abs_delta_logp']:.2g}, "
                                f"{100 * r['fraction_ratio_off_by_1pct']:.1f}% off >1%"
                                for r in rows))


# --- 4. a training run --------------------------------------------------------------------


@PARTS.register("train")
def train(ctx: Context, deadline: Deadline) -> dict:
  """ExGRPO steps of the config's run (its own dtype and sizes) until the deadline (at
  least one)."""
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
    # At least one step, however short the budget: the point is a real step on the device.
    while len(steps) < sz.train_max_steps and not (steps and deadline.passed()):
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
