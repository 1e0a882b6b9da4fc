"""Orbax checkpoints of a training run: everything needed to continue exactly.

Layout: `<workdir>/checkpoints/<step>/` with four items, written with the current
`ocp.args` API through one `CheckpointManager` (keep-last-N, atomic step directories):

  params  the policy parameters (restorable alone, for export and evaluation)
  opt     optimizer state (AdamW moments and its step count)
  host    host-side arrays: the replay buffer's contents
  meta    JSON: model config, run config, data-stream state, buffer scalars and RNG
          state, the delayed-start flag, the tokenizer source

Resume order (the trainer's): (1) the workdir's latest checkpoint; (2) the model path
in the config.

Multi-process runs: every process calls `save`/`restore` (Orbax synchronises them);
each writes and reads its own shards of `params` and `opt`, and only process 0 writes
the replicated `host` arrays and the `meta` JSON (Orbax writes replicated data from the
primary process). `restore` reads into the shardings of the given abstract trees, so a
checkpoint can be resumed on another mesh; export reads it onto one CPU.
"""

import dataclasses
import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from exgrpo_jax.models import config as config_lib

ITEMS = ("params", "opt", "host", "meta")


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


class CheckpointStore:
  """Saves and restores training state under `<workdir>/checkpoints`."""

  def __init__(self, workdir: str, keep: int = 2):
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=False)
    self._manager = ocp.CheckpointManager(checkpoint_dir(workdir), options=options,
                                          item_names=ITEMS)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, params, opt, host: dict, meta: dict) -> None:
    """Writes one checkpoint (blocking, so a SIGTERM handler can rely on it)."""
    host = {k: np.asarray(v) for k, v in host.items()}
    # Orbax cannot write zero-size arrays; their shape and dtype travel in meta.
    meta = dict(meta, empty_host_arrays={k: [list(v.shape), v.dtype.str]
                                         for k, v in host.items() if v.size == 0})
    host = {k: v for k, v in host.items() if v.size} or {"empty": np.zeros(())}
    self._manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt=ocp.args.StandardSave(opt),
        host=ocp.args.StandardSave(host),
        meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def restore_meta(self, step: int) -> dict:
    """Checkpoint `step`'s meta JSON alone (e.g. to check the config before the arrays)."""
    return self._manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore())).meta

  def restore(self, step: int, abstract_params, abstract_opt):
    """Returns (params, opt, host, meta); params/opt follow the abstract trees' shardings."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params),
        opt=ocp.args.StandardRestore(abstract_opt),
        host=ocp.args.StandardRestore(),
        meta=ocp.args.JsonRestore()))
    host = {k: np.asarray(v) for k, v in restored.host.items() if k != "empty"}
    for k, (shape, dtype) in restored.meta.pop("empty_host_arrays", {}).items():
      host[k] = np.zeros(shape, np.dtype(dtype))
    return restored.params, restored.opt, host, restored.meta

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


def latest_step_dir(path: str) -> str | None:
  """The step directory `path` names (a workdir, its checkpoints dir, or a step dir)."""
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, "meta")) and os.path.isdir(os.path.join(path, "params")):
    return path
  for candidate in (checkpoint_dir(path), path):
    if os.path.isdir(candidate):
      steps = [int(d) for d in os.listdir(candidate) if d.isdigit()
               and os.path.isdir(os.path.join(candidate, d, "meta"))]
      if steps:
        return os.path.join(candidate, str(max(steps)))
  return None


def is_training_checkpoint(path: str) -> bool:
  return os.path.isdir(path) and latest_step_dir(path) is not None


def load_policy_for_export(path: str):
  """(ModelConfig, params as numpy, tokenizer source) from a workdir or step directory."""
  step_dir = latest_step_dir(path)
  if step_dir is None:
    raise FileNotFoundError(f"{path}: no exgrpo_jax checkpoint found")
  with open(os.path.join(step_dir, "meta", "metadata")) as f:
    meta = json.load(f)
  checkpointer = ocp.StandardCheckpointer()
  params_dir = os.path.join(step_dir, "params")
  # Read onto this host's CPU whatever mesh wrote it (e.g. 8 GPUs or several hosts).
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu),
                        checkpointer.metadata(params_dir).item_metadata)
  params = jax.tree.map(np.asarray, checkpointer.restore(params_dir, target))
  return model_config_from_json(meta["model_config"]), params, meta["tokenizer_source"]
