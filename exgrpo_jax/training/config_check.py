"""Start-up validation of a training config: one clear line per mistake, before any work.

`check(config)` raises `ConfigError` listing every problem, one line each naming the key,
its value and what is allowed, for out-of-range values (rho outside [0, 1], K < 2, non-positive lengths, ...), batch sizes
that do not fit together, unknown names (loss, advantage, reward, template, engine,
trajectory selection), missing files and a data path that the configured source would
not read (`--config.KEY` typos, which the locked ConfigDict refuses, are named with the
closest valid key by `exgrpo_jax.config_cli`); `check_data_size` refuses a batch larger
than the training questions once they are loaded, `check_export_dir` an export that could
not be written, before the training. The mesh is checked by
`exgrpo_jax.sharding` when it is built; what a resumed run may change, by
`resume_check`.

A ConfigError is a `cli.UsageError`: the train CLI exits with status 2.
"""

import contextvars
import dataclasses
import math
import os

from exgrpo_jax import advantages
from exgrpo_jax import cli
from exgrpo_jax import losses
from exgrpo_jax import sampling
from exgrpo_jax import sharding
from exgrpo_jax.data import arithmetic
from exgrpo_jax.data import readers
from exgrpo_jax.data import rgym
from exgrpo_jax.data import sources as data_sources
from exgrpo_jax.data import templates
from exgrpo_jax.models import attention
from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import export
from exgrpo_jax.models import hub
from exgrpo_jax.models import lora
from exgrpo_jax.replay import buckets
from exgrpo_jax.replay import selection
from exgrpo_jax.rewards import graders
from exgrpo_jax.sampling import pages
from exgrpo_jax.sampling import vllm_setup
from exgrpo_jax.training import phase
from exgrpo_jax.training import run_log

# The model config also accepts float16; training is supported in these two.
DTYPES = ("float32", "bfloat16")


class ConfigError(cli.UsageError):
  """Config values that cannot work, one line each."""


# The lines `check` collects; None outside it (a problem then raises at once).
_PROBLEMS = contextvars.ContextVar("config_problems", default=None)


def _problem(line: str) -> None:
  lines = _PROBLEMS.get()
  if lines is None:
    raise ConfigError(line)
  lines.append(line)


def _require(ok: bool, key: str, value, allowed: str) -> None:
  if not ok:
    _problem(f"config.{key}={value!r}: {allowed}")


def _range(c, key: str, low=None, high=None, *, low_open=False, allow_none=False) -> None:
  """`config.<key>` within [low, high] (or (low, high] with low_open)."""
  value = c
  for part in key.split("."):
    value = value[part]
  if value is None and allow_none:
    return
  ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  if ok and low is not None:
    ok = value > low if low_open else value >= low
  if ok and high is not None:
    ok = value <= high
  bounds = f"{'(' if low_open else '['}{'-inf' if low is None else low}, " \
           f"{'inf' if high is None else high}]"
  _require(ok, key, value, f"must be a number in {bounds}")


def _known(key: str, value, names) -> None:
  names = list(names)
  _require(value in names, key, value, f"must be one of {', '.join(map(str, names))}")


def _file(key: str, path: str) -> None:
  _require(os.path.exists(path), key, path, "no such file")


def _data(key: str, spec: str, data_dir: str, source_key: str) -> None:
  others = ", ".join(n for n in data_sources.SOURCES.names() if n != "file")
  _require(bool(spec), key, spec, f"is required with {source_key}='file' (the default): "
           f"name a data file, or set {source_key} to one of {others}")
  problem = readers.missing(spec, data_dir)
  _require(problem is None, key, spec, problem)


def check(c) -> None:
  """Raises ConfigError listing every problem of training config `c`, one per line."""
  lines = []
  token = _PROBLEMS.set(lines)
  try:
    _check(c)
  except (ArithmeticError, TypeError, ValueError):
    # A check that reads a value already found bad (a zero optim.mini_batches divides)
    # has nothing to add to that value's line.
    if not lines:
      raise
  finally:
    _PROBLEMS.reset(token)
  if lines:
    raise ConfigError("\n".join(dict.fromkeys(lines)))


def _check(c) -> None:
  m = c.model
  _known("model.dtype", m.dtype, DTYPES)
  _known("model.param_dtype", m.param_dtype, DTYPES)
  _known("model.remat", m.remat, config_lib.REMATS)
  _known("model.attention", m.attention, attention.supported())
  _known("model.matmul_precision", m.matmul_precision, config_lib.MATMUL_PRECISIONS)
  if m.path:
    _require(os.path.exists(m.path), "model.path", m.path, hub.not_found(m.hub_id))
  for line in hub.config_problems(c):  # rope settings and positions, from its config.json
    _problem(line)
  for line in lora.config_problems(m.lora):
    _problem(line)

  _known("data.source", c.data.source, data_sources.SOURCES.names())
  if c.data.source == "file":
    _data("data.train_path", c.data.train_path, c.data.dir, "data.source")
  _only_with_file_source(c.data.train_path, "data.train_path", "data.source", c.data.source)
  for source, settings in (("arithmetic", arithmetic.ArithmeticSettings()),
                           ("reasoning_gym", rgym.GymSettings())):
    if source not in (c.data.source, c.eval.source):
      for key, default in dataclasses.asdict(settings).items():
        _unread(f"data.{source}.{key}", c.data[source][key], default,
                f"data.source or eval.source {source!r}",
                f"sources are {c.data.source!r} and {c.eval.source!r}",
                f"add --config.data.source={source}")
  try:  # generating both splits takes milliseconds and catches too-small settings
    if "arithmetic" in (c.data.source, c.eval.source):
      data_sources.from_arithmetic(c, "train")
  except (TypeError, ValueError) as e:
    _require(False, "data.arithmetic", c.data.arithmetic.to_dict(), str(e))
  try:
    if "reasoning_gym" in (c.data.source, c.eval.source):
      data_sources.from_reasoning_gym(c, "train")
  except (TypeError, ValueError) as e:
    _require(False, "data.reasoning_gym", c.data.reasoning_gym.to_dict(), str(e))
  _known("data.template", c.data.template, templates.TEMPLATES.names())
  _range(c, "data.max_prompt_tokens", 0, low_open=True)
  _range(c, "data.limit", 0)

  r = c.rollout
  _known("rollout.engine", r.engine, sampling.ENGINES.names())
  _known("rollout.scheduler", r.scheduler, sampling.SCHEDULERS)
  _range(c, "rollout.kv_pages", 0)
  _range(c, "rollout.kv_headroom", 0, 1)
  _require(r.kv_headroom < 1, "rollout.kv_headroom", r.kv_headroom,
           "must be below 1 (the share of the KV pool kept free when admitting)")
  _require(not r.kv_pages or r.scheduler == "continuous", "rollout.kv_pages", r.kv_pages,
           f"needs rollout.scheduler='continuous' (the static loop sizes its cache for "
           f"every row at its longest), not {r.scheduler!r}")
  if not r.kv_pages:
    _unread("rollout.kv_headroom", r.kv_headroom, pages.KV_HEADROOM,
            "a capped pool (rollout.kv_pages above 0)", "pool is uncapped (kv_pages=0)",
            "add --config.rollout.kv_pages=PAGES")
  _range(c, "rollout.max_rows", 0)
  _range(c, "rollout.k", 2)
  _range(c, "rollout.temperature", 0)
  _range(c, "rollout.top_p", 0, 1, low_open=True)
  _range(c, "rollout.top_k", 0)
  _range(c, "rollout.max_new_tokens", 0, low_open=True)
  if r.kv_pages > 0 and r.engine == "jax" and r.scheduler == "continuous":
    _pool_holds_a_row(c)
  if r.engine == "vllm":
    try:
      vllm_setup.VllmOptions.from_config(c)
    except ValueError as e:
      for line in str(e).splitlines():
        _problem(line)
  else:
    defaults = dataclasses.asdict(vllm_setup.VllmOptions(max_model_len=2))
    for key, value in r.vllm.items():
      _unread(f"rollout.vllm.{key}", value, defaults[key], "rollout.engine='vllm'",
              f"engine is {r.engine!r}", "add --config.rollout.engine=vllm")

  try:
    graders.load_plugins(c.reward.plugins)  # before reward.name: plugins add names
  except ImportError as e:
    _require(False, "reward.plugins", c.reward.plugins, str(e))
  if c.reward.name:
    _known("reward.name", c.reward.name, graders.REWARDS.names())
  _range(c, "reward.num_workers", 0)
  _range(c, "reward.timeout_s", 0, low_open=True)
  _range(c, "reward.correct_threshold")

  a = c.algo
  _known("algo.loss", a.loss, losses.POLICY_LOSSES.names())
  _known("algo.advantage", a.advantage, advantages.ADVANTAGES.names())
  _known("algo.aggregation", a.aggregation, losses.AGGREGATIONS)
  _known("algo.trajectory_selection", a.trajectory_selection, selection.SELECTIONS.names())
  _range(c, "algo.rho", 0, 1)
  _range(c, "algo.delayed_start", 0, 1)
  _range(c, "algo.clip_eps", 0, low_open=True)
  _range(c, "algo.shaping_gamma", 0, low_open=True, allow_none=True)
  _range(c, "algo.norm_len", 0, low_open=True)
  _range(c, "algo.entropy_coeff", 0)
  _known("algo.old_logp_source", a.old_logp_source, phase.OLD_LOGP_SOURCES)
  _require(a.old_logp_source != "rollout" or r.temperature == 1, "algo.old_logp_source",
           a.old_logp_source, f"needs rollout.temperature=1, not {r.temperature} (the "
           "rollout's log-probs are of the temperature-scaled distribution)")
  cap = a.tis_cap
  _require(cap is None or isinstance(cap, (int, float)) and not isinstance(cap, bool)
           and (cap == 0 or 1 < cap < math.inf), "algo.tis_cap", cap,
           "must be 0 or None (off) or a finite number above 1 (the cap C of the TIS "
           "weight)")
  _require(not cap or a.old_logp_source != "rollout", "algo.tis_cap", cap,
           "needs the learner's recomputed old log-probs; algo.old_logp_source='rollout' "
           "has none (use auto or recompute)")

  _require(c.replay.k == r.k, "replay.k", c.replay.k,
           f"must equal rollout.k={r.k} (it is derived from it; override rollout.k)")
  _range(c, "replay.mu", 0, 1)
  _range(c, "replay.sigma", 0, low_open=True, allow_none=True)
  _known("replay.weighting", c.replay.weighting, buckets.WEIGHTINGS)
  _known("replay.bucketing", c.replay.bucketing, buckets.BUCKETINGS)
  _range(c, "replay.max_per_question", 0)
  _range(c, "replay.max_total", 0)

  o = c.optim
  for key in ("lr", "grad_clip", "skip_grad_norm"):
    _range(c, f"optim.{key}", 0, low_open=True)
  _range(c, "optim.weight_decay", 0)
  _range(c, "optim.b1", 0, 1)
  _range(c, "optim.b2", 0, 1)
  _range(c, "optim.mini_batches", 1)
  _range(c, "optim.micro_batch_size", 1)

  t = c.train
  for key in ("steps", "batch_questions", "log_every", "checkpoint_every",
              "keep_checkpoints", "logprob_chunk", "prompt_bucket"):
    _range(c, f"train.{key}", 1)
  _require(isinstance(t.seed, int) and not isinstance(t.seed, bool) and 0 <= t.seed < 2**63,
           "train.seed", t.seed, "must be a whole number in [0, 2**63)")
  responses = t.batch_questions * r.k
  _require(responses >= o.mini_batches, "optim.mini_batches", o.mini_batches,
           f"more than the {responses} responses per step (train.batch_questions x "
           "rollout.k): some optimizer steps would be empty")
  per_mini = -(-responses // o.mini_batches)
  _require(o.micro_batch_size <= per_mini, "optim.micro_batch_size", o.micro_batch_size,
           f"larger than a mini-batch ({per_mini} responses = train.batch_questions x "
           "rollout.k / optim.mini_batches): the rest would be padding")

  for key in ("checkpoint_every_minutes", "export_every_minutes", "budget_hours"):
    _range(c, f"train.{key}", 0)
  _require(not t.export_every_minutes or bool(t.export_dir), "train.export_every_minutes",
           t.export_every_minutes, "needs train.export_dir (the directory exports go to), "
           "which is empty")
  if not t.budget_hours:
    _unread("train.budget_plan", t.budget_plan, "", "train.budget_hours above 0",
            "budget_hours is 0", "add --config.train.budget_hours=HOURS")
  elif t.budget_plan:
    _file("train.budget_plan", t.budget_plan)  # its content: budget.read_plan

  try:
    run_log.parse_loggers(t.loggers)
  except ValueError as e:
    _require(False, "train.loggers", t.loggers, str(e))

  e = c.eval
  _range(c, "eval.every", 0)
  _known("eval.before_train", e.before_train, (None, True, False))
  _known("eval.source", e.source, data_sources.SOURCES.names())
  _only_with_file_source(e.path, "eval.path", "eval.source", e.source)
  _range(c, "eval.samples", 0)
  if e.every or e.before_train:
    if e.source == "file":
      _data("eval.path", e.path, c.data.dir, "eval.source")
    _range(c, "eval.limit", 0)
    _known("eval.subset", e.subset, data_sources.SUBSETS)
    if not e.limit:
      _unread("eval.subset", e.subset, "first", "eval.limit above 0", "limit is 0 (all)",
              "add --config.eval.limit=N")
    _range(c, "eval.temperature", 0)
    _range(c, "eval.max_new_tokens", 0, low_open=True)
    _range(c, "eval.n", 1)


def ignored(c) -> list[str]:
  """Settings of training config `c` that its rollout engine does not read, one line
  each, said at start-up rather than refused: the GPU configs plan rollout.max_rows
  for the JAX engine, and `--config.rollout.engine=vllm` must still run them."""
  r = c.rollout
  if r.engine != "vllm":
    return []
  lines = []
  if r.max_rows:
    lines.append(f"config.rollout.max_rows={r.max_rows} sizes the JAX sampler's KV cache; "
                 "the vllm engine ignores it (rollout.vllm.max_num_seqs bounds its batch)")
  if r.kv_pages:
    lines.append(f"config.rollout.kv_pages={r.kv_pages} sizes the JAX sampler's KV pool; "
                 "the vllm engine ignores it (rollout.vllm.gpu_memory_utilization sizes "
                 "its own)")
  if r.scheduler != "continuous":  # the default
    lines.append(f"config.rollout.scheduler={r.scheduler!r} is the JAX sampler's; the vllm "
                 "engine schedules its own rows")
  return lines


def _unread(key: str, value, default, needs: str, have: str, fix: str) -> None:
  """Refuses `config.<key>` set away from its default where this run would not read it."""
  _require(value == default, key, value,
           f"is read only with {needs}, and this run's {have}; drop it, or {fix}")


def _pool_holds_a_row(c) -> None:
  """Refuses a `rollout.kv_pages` whose share per batch shard is below one row at its
  longest (`data.max_prompt_tokens` + `rollout.max_new_tokens`): no row could finish."""
  r = c.rollout
  try:
    shards = sharding.batch_shards(sharding.make_mesh(c.mesh))
  except ValueError:
    return  # the mesh's own check names its problem when the run builds it
  per_row = pages.pages_per_row(c.data.max_prompt_tokens, r.max_new_tokens)
  _require(r.kv_pages // shards >= per_row, "rollout.kv_pages", r.kv_pages,
           f"{r.kv_pages // shards} pages per batch shard of the mesh's {shards}, fewer than "
           f"one row at its longest ({per_row} pages of {pages.PAGE} tokens for "
           f"data.max_prompt_tokens={c.data.max_prompt_tokens} + "
           f"rollout.max_new_tokens={r.max_new_tokens}), which could never finish; raise "
           f"it to at least {per_row * shards} or lower those lengths")


def _only_with_file_source(path: str, key: str, source_key: str, source: str) -> None:
  _require(not path or source == "file", key, path,
           f"is read only with {source_key}='file', and this config's source is "
           f"{source!r}; add --config.{source_key}=file, or drop the path")


def check_export_dir(c, workdir: str) -> None:
  """Raises ConfigError if the final export (`train.export_dir` under `workdir`) could not
  be written: found before the training, not after it."""
  if not c.train.export_dir:
    return
  dst = os.path.abspath(os.path.join(workdir, c.train.export_dir))
  why = (f"{dst} exists and is not a model directory" if not export.replaceable(dst)
         else cli.unwritable(dst, directory=True))
  _require(why is None, "train.export_dir", c.train.export_dir,
           f"cannot write the export there ({why})")


def check_data_size(c, num_questions: int, source: str) -> None:
  """Raises ConfigError if a batch needs more distinct questions than `source` has."""
  _require(c.train.batch_questions <= num_questions, "train.batch_questions",
           c.train.batch_questions, f"more than the {num_questions} training questions of "
           f"{source} (a batch never holds a question twice); lower it, or raise data.limit")
