"""Everything a run carries between steps, built fresh or restored from a checkpoint.

Model config and weights, optimizer state, the replay buffer, the question stream and
the step counters; rewards and validation live in `grading`, the learner in `actor`.

Resume order: (1) the latest checkpoint in `<workdir>/checkpoints` (params, optimizer,
step, buffer, data stream, delayed-start flag; PRNG keys are derived from the seed and
the step, so they need no storage); (2) `config.model.path` (or random weights for
`model.random_init`) with a fresh optimizer, buffer and stream.

With LoRA (`model.lora.rank` > 0) `params` is a `lora.LoraParams`: the base is loaded
as above on every start (`lora_base`), the adapters and their optimizer state are what the
checkpoint holds (`lora_run`).

Params and optimizer state live on the mesh `config.mesh` with the learner's sharding
rules (`exgrpo_jax.sharding`); they are created, loaded or restored shard by shard, never
whole on one device. In a multi-process run every process holds the same host state
(see `exgrpo_jax.distributed`).
"""

import json
import os
import sys

import jax

from exgrpo_jax import checkpointing
from exgrpo_jax import data
from exgrpo_jax import distributed
from exgrpo_jax import models
from exgrpo_jax import rewards
from exgrpo_jax import sampling
from exgrpo_jax import sharding
from exgrpo_jax.models import loading
from exgrpo_jax.models import lora
from exgrpo_jax.models import lora_base
from exgrpo_jax.replay import buffer as buffer_lib
from exgrpo_jax.training import config_check
from exgrpo_jax.training import learner
from exgrpo_jax.training import lora_run
from exgrpo_jax.training import resume_check


def _model_config_for_random_init(config, tokenizer) -> models.ModelConfig:
  return models.ModelConfig(
      vocab_size=len(tokenizer), eos_token_id=(tokenizer.eos_token_id,),
      pad_token_id=tokenizer.pad_token_id, dtype=config.model.dtype,
      param_dtype=config.model.param_dtype, remat=config.model.remat,
      attention=config.model.attention, **config.model.arch.to_dict())


class RunState:
  """Model, optimizer state, replay buffer, question stream and counters.

  `params` and `opt_state` are abstract (sharded ShapeDtypeStructs) until
  `init_weights()` or `load(...)`; `create_or_restore` calls one of them.
  """

  def __init__(self, config, workdir: str):
    self.config = config
    self.workdir = workdir
    self.step = 0
    self.replay_started = config.algo.delayed_start <= 0

    m = config.model
    self.tokenizer_source = m.tokenizer or m.path or models.default_model_path()
    self.tokenizer = models.load_tokenizer(self.tokenizer_source)
    self.pad_id = self.tokenizer.pad_token_id
    if m.random_init:
      self.model_cfg = _model_config_for_random_init(config, self.tokenizer)
    else:
      self._hf_dir = models.resolve_hf_dir(m.path or models.default_model_path())
      self.model_cfg = loading.read_config(self._hf_dir, dtype=m.dtype,
                                           param_dtype=m.param_dtype, remat=m.remat,
                                           attention=m.attention)
    self.mesh = sharding.make_mesh(config.mesh)
    if config.optim.micro_batch_size % sharding.batch_shards(self.mesh):
      print(f"[exgrpo_jax] warning: optim.micro_batch_size={config.optim.micro_batch_size} "
            f"is not a multiple of the mesh's {sharding.batch_shards(self.mesh)} batch "
            "shards (data x fsdp): every device will compute whole micro-batches",
            file=sys.stderr)
    self._tx = learner.make_optimizer(config.optim)
    self.params, self.opt_state = learner.abstract_state(self.model_cfg, self._tx, self.mesh)
    self.param_shardings, self.opt_shardings = sharding.shardings_of(
        (self.params, self.opt_state))
    self._base_fingerprint = None
    if lora_run.enabled(config):
      # The learner's trainable params are the adapters; the base keeps param_shardings
      # (a quantized base: its codes like the weights, `lora_run.base_shardings`).
      self.base_shardings = lora_run.base_shardings(config, self.model_cfg, self.mesh)
      self.param_shardings = lora_run.adapter_shardings(config, self.model_cfg, self.mesh)
      abstract = lora.abstract_adapters(self.model_cfg, m.lora.rank, tuple(m.lora.targets))
      self.opt_shardings = sharding.optimizer_shardings(self._tx, abstract,
                                                        self.param_shardings)
      self.params = sharding.abstract(abstract, self.param_shardings)
      self.opt_state = sharding.abstract(jax.eval_shape(self._tx.init, abstract),
                                         self.opt_shardings)

    # Custom rewards register themselves on import; the data loader checks reward names.
    rewards.load_plugins(config.reward.plugins)
    self.prompts, self.data_stats = self._load_prompts()
    self._by_uid = {p.question.uid: p for p in self.prompts}
    self.stream = data.QuestionStream([p.question for p in self.prompts],
                                      seed=config.train.seed)
    self.buffer = buffer_lib.ExperienceBuffer(self._buffer_config(), seed=config.train.seed)
    self.sampling_config = sampling.SamplingConfig.for_rollout(config.rollout)
    # Last: it creates <workdir>/checkpoints, which a refused config must not leave.
    self.store = checkpointing.CheckpointStore(workdir, keep=config.train.keep_checkpoints)

  def _buffer_config(self) -> dict:
    return dict(self.config.replay.to_dict(), vocab_size=self.model_cfg.vocab_size,
                correct_threshold=self.config.reward.correct_threshold)

  def _load_prompts(self):
    """Training questions (`data.source`) rendered with the template (too long: dropped)."""
    cfg = self.config
    loaded = data.sources.load(cfg, "train")
    path = loaded.path
    prompts, dropped = data.render_prompts(loaded.questions, self.tokenizer,
                                           template=cfg.data.template,
                                           max_prompt_tokens=cfg.data.max_prompt_tokens)
    if not prompts:
      raise ValueError(f"{path}: no usable questions ({len(loaded.skipped)} bad rows, "
                       f"{dropped} longer than data.max_prompt_tokens)")
    print(f"[exgrpo_jax] {path}: {len(prompts)} questions ({len(loaded.skipped)} bad rows "
          f"skipped, {dropped} prompts over {cfg.data.max_prompt_tokens} tokens dropped)",
          file=sys.stderr)
    config_check.check_data_size(cfg, len(prompts), path)
    return prompts, {"rows_skipped": len(loaded.skipped), "prompts_too_long": dropped}

  @classmethod
  def create_or_restore(cls, config, workdir: str) -> "RunState":
    state = cls(config, workdir)
    # Damaged newer checkpoints are reported and moved aside (checkpointing.py); a config
    # the checkpoint cannot follow is refused before any array is read.
    try:
      restored = state.store.restore_newest_intact(
          sharding.abstract(state.params, state.param_shardings),
          sharding.abstract(state.opt_state, state.opt_shardings), state.check_resume)
    except BaseException:
      state.close()
      raise
    if restored is None:
      state.init_weights()
    else:
      state.load(*restored[1])
      print(f"[exgrpo_jax] resumed from {state.store.step_dir(restored[0])}", file=sys.stderr)
    return state

  def init_weights(self) -> None:
    """Initial params (random or `model.path`; with LoRA, the base and new adapters) and
    a fresh optimizer, created sharded."""
    if not lora_run.enabled(self.config):
      self.params = self._base_weights(self.param_shardings)
      self.opt_state = sharding.init_optimizer(self._tx, self.params, self.opt_shardings)
      return
    adapters = lora_run.init_adapters(self.config, self.model_cfg, self.param_shardings)
    self.params = lora_base.combine(self.config, self._base_weights(self.base_shardings),
                                   adapters)
    self.opt_state = sharding.init_optimizer(self._tx, adapters, self.opt_shardings)

  def _base_weights(self, shardings):
    return lora_base.base_weights(self.config, self.model_cfg, shardings)

  def base_fingerprint(self) -> dict:
    """The LoRA base's path and content hash (`lora_base.base_fingerprint`), computed once."""
    if self._base_fingerprint is None:
      path = self.config.model.path or models.default_model_path()
      self._base_fingerprint = lora_base.base_fingerprint(self.config, path)
    return self._base_fingerprint

  def prompt(self, uid: int) -> data.Prompt:
    return self._by_uid[uid]

  # --- checkpoints --------------------------------------------------------------------------

  def save(self) -> None:
    meta = dict(
        step=self.step, replay_started=self.replay_started,
        stream=self.stream.state_dict(),
        model_config=checkpointing.model_config_to_json(self.model_cfg),
        tokenizer_source=os.path.abspath(self.tokenizer_source)
        if os.path.exists(self.tokenizer_source) else self.tokenizer_source,
        config=self.config.to_dict())
    trainable = self.params
    if lora_run.enabled(self.config):
      meta["lora_base"] = self.base_fingerprint()
      trainable = self.params.adapters
    host = self.buffer.state_dict()
    self.check_host_state(host, meta)
    self.store.save(self.step, trainable, self.opt_state, host, meta)

  def check_host_state(self, host: dict, meta: dict) -> None:
    """Digest of the host state (buffer, stream, counters), checked equal on all processes."""
    scalars = {k: meta[k] for k in ("step", "replay_started", "stream")}
    hex_digest = distributed.digest(host, json.dumps(scalars, sort_keys=True, default=str))
    if jax.process_count() > 1:
      print(f"[exgrpo_jax] process {jax.process_index()}: host state digest {hex_digest} "
            f"at step {self.step}", file=sys.stderr)
    distributed.check_same_on_all_processes(hex_digest, f"host state at step {self.step}")

  def check_resume(self, meta: dict) -> None:
    """Refuses (ConfigError) a config the checkpoint with `meta` cannot follow; prints a
    warning line per other change that alters the run (`resume_check`)."""
    warnings = resume_check.check(meta["config"], self.config, meta["step"])
    resume_check.check_model(meta["model_config"], self.model_cfg, self.config)
    lora_run.check_resume(meta, self.config, self.base_fingerprint)
    for line in warnings:
      print(f"[exgrpo_jax] warning: {line}", file=sys.stderr, flush=True)

  def load(self, params, opt, host: dict, meta: dict) -> None:
    """Takes over a restored checkpoint (`CheckpointStore.restore`'s four parts, checked
    by `check_resume`); the run's config applies from here on (the buffer's sampling and
    caps included)."""
    self.params, self.opt_state = params, opt
    if lora_run.enabled(self.config):
      self.params = lora_base.combine(self.config, self._base_weights(self.base_shardings),
                                     params)
    self.buffer = buffer_lib.ExperienceBuffer.from_state_dict(host, self._buffer_config())
    self.stream.load_state_dict(meta["stream"])
    self.step = int(meta["step"])
    self.replay_started = bool(meta["replay_started"]) or self.replay_started

  def close(self) -> None:
    self.store.close()
