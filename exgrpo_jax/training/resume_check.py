"""What a resumed run may change, key by key: refused, taken with a warning, or free.

  warnings = resume_check.check(saved_config, config)    # ConfigError names a refusal
  resume_check.check_model(saved_model_config, model_cfg, config)

Both run on the checkpoint's `meta` before any array is restored (`RunState`), so a
changed model shape is named as a config change instead of failing the restore as if
the checkpoint were damaged, and nothing is moved aside.

Refused (`FIXED`), because the checkpoint's state was built for the saved value: K, the
model (a LoRA run's base by its weights' content, whatever its path) and its tokenizer,
the question set, and `train.seed` (the restored question stream and buffer keep drawing
from the checkpoint's seed, so a new one would reach only the rollouts). Free (`FREE`),
because they change how the run is carried out, not what it computes: its length,
logging, checkpoints, evaluation, mesh, the rollout engine's and reward workers'
settings, the micro-batch size. Every other key (the algorithm, replay, optimizer,
sampling, reward, batch size) is taken from the resumed step on with one warning line
per changed key: the run is then no longer one config's.
"""

import dataclasses
import json

from exgrpo_jax import config_cli
from exgrpo_jax.training import config_check

# Keys (or prefixes, ending in ".") a resumed run must keep.
FIXED = ("rollout.k", "model.path", "model.tokenizer", "model.random_init", "model.arch.",
         "data.source", "data.arithmetic.", "data.reasoning_gym.", "data.train_path",
         "data.limit", "data.max_prompt_tokens", "train.seed")
# Keys a resumed run may change without a word.
FREE = ("model.remat", "model.attention", "model.matmul_precision", "data.dir",
        "rollout.engine", "rollout.max_rows", "rollout.scheduler", "rollout.kv_pages",
        "rollout.kv_headroom", "rollout.vllm.", "model.hub_id",
        "reward.num_workers", "reward.timeout_s", "optim.micro_batch_size", "train.steps",
        "train.log_every", "train.checkpoint_every", "train.checkpoint_every_minutes",
        "train.export_every_minutes", "train.budget_hours", "train.budget_plan",
        "train.keep_checkpoints",
        "train.logprob_chunk", "train.packing", "train.prompt_bucket", "train.export_dir",
        "train.loggers", "train.compile_cache", "eval.", "mesh.")
# ModelConfig fields that follow the run's config, not the weights.
_RUNTIME_FIELDS = ("dtype", "param_dtype", "remat", "attention")


def _matches(key: str, prefixes) -> bool:
  return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)


def check(saved: dict, c, step: int | None = None) -> list[str]:
  """Raises ConfigError if `c` changes a FIXED key of the checkpoint's `saved` config;
  returns one warning line per other changed key that is not FREE."""
  before, now = config_cli.flatten(saved), config_cli.flatten(c.to_dict())
  # A LoRA run's frozen base is judged by its content (`lora_run.check_resume`): the same
  # weights at another path resume.
  lora_runs = before.get("model.lora.rank", 0) > 0 and now["model.lora.rank"] > 0
  by_content = ("model.path",) if lora_runs else ()
  changed = [k for k in sorted(now)
             if k in before and before[k] != now[k] and k not in by_content]
  for key in changed:
    if _matches(key, FIXED):
      raise config_check.ConfigError(
          f"config.{key}={now[key]!r}: the checkpoint being resumed was trained with "
          f"{before[key]!r}; resume with that value or start a new workdir")
  at = f" at step {step}" if step is not None else ""
  return [f"config.{key}={now[key]!r} differs from the checkpoint's {before[key]!r}{at}; "
          "the resumed run uses the new value" for key in changed if not _matches(key, FREE)]


def check_model(saved: dict, model_cfg, c) -> None:
  """Raises ConfigError if the model the config names is not the checkpoint's (say, the
  file at `model.path` was replaced by another model)."""
  # As JSON on both sides (tuples become lists in the checkpoint's meta).
  saved, now = (json.loads(json.dumps(d)) for d in (saved, dataclasses.asdict(model_cfg)))
  diffs = [f"{k} {saved[k]!r} -> {v!r}" for k, v in now.items()
           if k not in _RUNTIME_FIELDS and k in saved and saved[k] != v]
  if diffs:
    # Random weights take their shape from model.arch (a FIXED key) and the tokenizer.
    key = "tokenizer" if c.model.random_init else "path"
    raise config_check.ConfigError(
        f"config.model.{key}={c.model[key]!r}: the model differs from the one the "
        f"checkpoint being resumed was trained with ({', '.join(diffs)}); resume with that "
        "model or start a new workdir")
