"""Orbax checkpoints of a training run: everything needed to continue exactly.

Layout: `<workdir>/checkpoints/<step>/` with four items, written with the current
`ocp.args` API through one `CheckpointManager` (atomic step directories):

  params  the policy parameters (restorable alone, for export and evaluation)
  opt     optimizer state (AdamW moments and its step count)
  host    host-side arrays: the replay buffer's contents
  meta    JSON: model config, run config, data-stream state, buffer scalars and RNG
          state, the delayed-start flag, the tokenizer source

and `MANIFEST`: the size and CRC-32 of every file, written once Orbax has finished
(`checkpoint_integrity.py`).

Integrity: `save` refuses non-finite parameters; `restore_newest_intact` verifies the
manifest, restores, and checks every restored array's shape and finiteness, falling
back to the next older step (one line per damaged step, which is moved to
`<workdir>/checkpoints.damaged/` so the run can write that step again). Rotation keeps
the `keep` newest checkpoints and runs only after the new one's manifest is written, so
the last good checkpoint is never deleted before its successor is complete.

Resume order (the trainer's): (1) the workdir's newest intact checkpoint; (2) the model
path in the config.

Multi-process runs: every process calls `save`/`restore` (Orbax synchronises them);
each writes and reads its own shards of `params` and `opt`, and only process 0 writes
the replicated `host` arrays, the `meta` JSON and the manifest (which assumes the
shared file system Orbax needs anyway). `restore` reads into the shardings of the given
abstract trees, so a checkpoint can be resumed on another mesh; export reads it onto
one CPU.
"""

import dataclasses
import json
import os
import shutil
import sys

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp

from exgrpo_jax import checkpoint_integrity as integrity
from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import lora_base

ITEMS = ("params", "opt", "host", "meta")
MANIFEST = integrity.MANIFEST
CheckpointError = integrity.CheckpointError


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


def damaged_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints.damaged")


class CheckpointStore:
  """Saves, verifies and restores training state under `<workdir>/checkpoints`."""

  def __init__(self, workdir: str, keep: int = 2):
    self.workdir = workdir
    self.keep = keep
    self.directory = checkpoint_dir(workdir)
    # Rotation is ours (after the manifest is written), not Orbax's.
    options = ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                           enable_async_checkpointing=False,
                                           cleanup_tmp_directories=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=ITEMS)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, params, opt, host: dict, meta: dict) -> None:
    """Writes one checkpoint (blocking, so a SIGTERM handler can rely on it)."""
    if not integrity.all_finite(params):
      raise CheckpointError(f"step {step}: the parameters are not finite; not checkpointed")
    host = {k: np.asarray(v) for k, v in host.items()}
    # Orbax cannot write zero-size arrays; their shape and dtype travel in meta.
    meta = dict(meta, empty_host_arrays={k: [list(v.shape), v.dtype.str]
                                         for k, v in host.items() if v.size == 0})
    host = {k: v for k, v in host.items() if v.size} or {"empty": np.zeros(())}
    try:
      self._manager.save(step, args=ocp.args.Composite(
          params=ocp.args.StandardSave(params),
          opt=ocp.args.StandardSave(opt),
          host=ocp.args.StandardSave(host),
          meta=ocp.args.JsonSave(meta)), force=True)
      self._manager.wait_until_finished()
      if jax.process_index() == 0:
        integrity.write_manifest(self.step_dir(step))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"writing checkpoint {self.step_dir(step)} failed: "
                            f"{integrity.root_cause(e)}") from e
    self._rotate()

  def _rotate(self) -> None:
    for old in sorted(self._manager.all_steps())[:-self.keep]:
      self._manager.delete(old)

  def restore(self, step: int, abstract_params, abstract_opt, check_meta=None):
    """Returns (params, opt, host, meta); params/opt follow the abstract trees' shardings.

    Raises CheckpointError naming what is wrong if the step is damaged. `check_meta`
    sees the step's meta before any array is read and may refuse it (its exception
    propagates: a config that does not fit the checkpoint is no damage).
    """
    reason = integrity.damage(self.step_dir(step), ITEMS)
    if reason:
      raise CheckpointError(reason)
    if check_meta is not None:
      check_meta(_read_meta(self.step_dir(step)))
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(abstract_params),
          opt=ocp.args.StandardRestore(abstract_opt),
          host=ocp.args.StandardRestore(),
          meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"Orbax cannot read it ({integrity.root_cause(e)})") from e
    integrity.check_arrays("params", restored.params, abstract_params)
    integrity.check_arrays("opt", restored.opt, abstract_opt)
    host = {k: np.asarray(v) for k, v in restored.host.items() if k != "empty"}
    for k, (shape, dtype) in restored.meta.pop("empty_host_arrays", {}).items():
      host[k] = np.zeros(shape, np.dtype(dtype))
    return restored.params, restored.opt, host, restored.meta

  def restore_newest_intact(self, abstract_params, abstract_opt, check_meta=None):
    """(step, (params, opt, host, meta)) of the newest intact checkpoint, or None if there
    is none at all. Damaged newer steps are reported and moved aside; if every step is
    damaged nothing is moved and CheckpointError says so. An exception from `check_meta`
    (see `restore`) propagates before anything is moved."""
    damaged = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        restored = self.restore(step, abstract_params, abstract_opt, check_meta)
      except CheckpointError as e:
        damaged.append((step, str(e)))
        continue
      for bad, reason in damaged:
        moved = self._move_aside(bad)
        print(f"[exgrpo_jax] checkpoint {bad} is damaged ({reason}): moved to {moved}; "
              f"falling back to step {step}", file=sys.stderr, flush=True)
      return step, restored
    if damaged:
      raise CheckpointError(f"{self.directory}: no intact checkpoint (" + "; ".join(
          f"step {s}: {r}" for s, r in damaged) + "); move the directory away to start over")
    return None

  def _move_aside(self, step: int) -> str:
    if jax.process_index() == 0:
      os.makedirs(damaged_dir(self.workdir), exist_ok=True)
      dst, n = os.path.join(damaged_dir(self.workdir), str(step)), 1
      while os.path.exists(dst):
        dst, n = os.path.join(damaged_dir(self.workdir), f"{step}.{n}"), n + 1
      shutil.move(self.step_dir(step), dst)
    else:
      dst = damaged_dir(self.workdir)
    self._manager.reload()
    return dst

  def close(self):
    self._manager.close()


def model_config_to_json(cfg: config_lib.ModelConfig) -> dict:
  return dataclasses.asdict(cfg)


def model_config_from_json(d: dict) -> config_lib.ModelConfig:
  d = dict(d)
  d["eos_token_id"] = tuple(d.get("eos_token_id") or ())
  if d.get("rope_scaling"):
    d["rope_scaling"] = tuple((k, v) for k, v in d["rope_scaling"])
  return config_lib.ModelConfig(**d)


def step_dirs(path: str) -> list[str]:
  """The step directories `path` names (a workdir, its checkpoints dir, or a step dir),
  newest first."""
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, "meta")) and os.path.isdir(os.path.join(path, "params")):
    return [path]
  for candidate in (checkpoint_dir(path), path):
    if os.path.isdir(candidate):
      steps = sorted((int(d) for d in os.listdir(candidate) if d.isdigit()
                      and os.path.isdir(os.path.join(candidate, d, "meta"))), reverse=True)
      if steps:
        return [os.path.join(candidate, str(s)) for s in steps]
  return []


def latest_step_dir(path: str) -> str | None:
  return next(iter(step_dirs(path)), None)


def is_training_checkpoint(path: str) -> bool:
  return os.path.isdir(path) and latest_step_dir(path) is not None


def is_lora_checkpoint(path: str) -> bool:
  """Whether `path` is a workdir or step directory whose newest step holds LoRA adapters."""
  step_dir = latest_step_dir(path) if os.path.isdir(path) else None
  try:
    return step_dir is not None and "lora_base" in _read_meta(step_dir)
  except CheckpointError:
    return False


def _read_meta(step_dir: str) -> dict:
  """The `meta` item's JSON, read directly (the step is checked by its manifest first)."""
  try:
    with open(os.path.join(step_dir, "meta", "metadata"), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"unreadable meta ({e})") from e


def _load_params(step_dir: str):
  reason = integrity.damage(step_dir, ITEMS)
  if reason:
    raise CheckpointError(reason)
  meta = _read_meta(step_dir)
  # The item's handler, not a Checkpointer: that looks for a step's metadata file inside
  # the item directory and warns that it does not exist (the manager keeps it a level up).
  handler = ocp.StandardCheckpointHandler()
  params_dir = epath.Path(step_dir) / "params"
  # Read onto this host's CPU whatever mesh wrote it (e.g. 8 GPUs or several hosts).
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  try:
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu),
                          handler.metadata(params_dir))
    params = jax.tree.map(np.asarray, handler.restore(
        params_dir, args=ocp.args.StandardRestore(target)))
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"Orbax cannot read it ({integrity.root_cause(e)})") from e
  finally:
    handler.close()
  integrity.check_arrays("params", params, target)
  cfg = model_config_from_json(meta["model_config"])
  if "lora_base" in meta:  # the adapters, on the base the checkpoint names
    params = lora_base.with_checkpoint_base(meta, cfg, params)
  return cfg, params, meta


def load_policy_for_export(path: str):
  """(ModelConfig, params as numpy, tokenizer source) from a workdir or step directory
  (`load_for_export`)."""
  cfg, params, meta = load_for_export(path)
  return cfg, params, meta["tokenizer_source"]


def load_for_export(path: str):
  """(ModelConfig, params as numpy, the step's meta) from a workdir or step directory:
  its newest intact step (a damaged newer one is skipped with one line). A LoRA
  checkpoint's params are `lora.LoraParams`: its adapters on the base it names."""
  candidates = step_dirs(path)
  if not candidates:
    raise FileNotFoundError(f"{path}: no exgrpo_jax checkpoint found")
  reasons = []
  for step_dir in candidates:
    try:
      loaded = _load_params(step_dir)
    except CheckpointError as e:
      reasons.append(f"{step_dir}: {e}")
      continue
    for reason in reasons:
      print(f"[exgrpo_jax] skipped damaged checkpoint {reason}", file=sys.stderr, flush=True)
    return loaded
  raise CheckpointError(f"no intact checkpoint in {path} ({'; '.join(reasons)})")
