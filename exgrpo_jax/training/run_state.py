"""Everything a run carries between steps, built fresh or restored from a checkpoint.

Resume order: (1) the latest checkpoint in `<workdir>/checkpoints` (params, optimizer,
step, buffer, data stream, delayed-start flag; PRNG keys are derived from the seed and
the step, so they need no storage); (2) `config.model.path` (or random weights for
`model.random_init`) with a fresh optimizer, buffer and stream.

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
from exgrpo_jax import evaluation
from exgrpo_jax import models
from exgrpo_jax import rewards
from exgrpo_jax import sampling
from exgrpo_jax import sharding
from exgrpo_jax.models import loading
from exgrpo_jax.replay import buffer as buffer_lib
from exgrpo_jax.training import learner


def _model_config_for_random_init(config, tokenizer) -> models.ModelConfig:
  return models.ModelConfig(
      vocab_size=len(tokenizer), eos_token_id=(tokenizer.eos_token_id,),
      pad_token_id=tokenizer.pad_token_id, dtype=config.model.dtype,
      param_dtype=config.model.param_dtype, remat=config.model.remat,
      attention=config.model.attention, **config.model.arch.to_dict())


class RunState:
  """Model, optimizer state, replay buffer, question stream, reward pool and counters.

  `params` and `opt_state` are abstract (sharded ShapeDtypeStructs) until
  `init_weights()` or `restore(step)`; `create_or_restore` calls one of them.
  """

  def __init__(self, config, workdir: str):
    self.config = config
    self.workdir = workdir
    self.store = checkpointing.CheckpointStore(workdir, keep=config.train.keep_checkpoints)
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
    self.param_shardings = sharding.param_shardings(self.model_cfg, self.mesh)
    self._tx = learner.make_optimizer(config.optim)
    self.opt_shardings = sharding.optimizer_shardings(self._tx, self.model_cfg,
                                                      self.param_shardings)
    self.params = sharding.abstract(models.abstract_params(self.model_cfg),
                                    self.param_shardings)
    self.opt_state = sharding.abstract(jax.eval_shape(self._tx.init, self.params),
                                       self.opt_shardings)

    # Custom rewards register themselves on import; the data loader checks reward names.
    plugins = rewards.load_plugins(config.reward.plugins)
    self.prompts, self.data_stats = self._load_prompts(config.data.train_path,
                                                       config.data.limit)
    self._by_uid = {p.question.uid: p for p in self.prompts}
    self.stream = data.QuestionStream([p.question for p in self.prompts],
                                      seed=config.train.seed)
    self.buffer = buffer_lib.ExperienceBuffer(
        dict(config.replay.to_dict(), vocab_size=self.model_cfg.vocab_size),
        seed=config.train.seed)
    self.reward_pool = rewards.RewardPool(num_workers=config.reward.num_workers,
                                          timeout_s=config.reward.timeout_s,
                                          plugin_modules=plugins)
    self.sampling_config = sampling.SamplingConfig(
        temperature=config.rollout.temperature, top_p=config.rollout.top_p,
        top_k=config.rollout.top_k, max_new_tokens=config.rollout.max_new_tokens)
    self._eval_questions = None

  def _load_prompts(self, path: str, limit: int):
    """Questions of `path` rendered with the configured template (too long: dropped)."""
    cfg = self.config
    loaded = data.load_questions(path, skip_bad_rows=cfg.data.skip_bad_rows, limit=limit,
                                 reward_name=cfg.reward.name)
    prompts, dropped = data.render_prompts(loaded.questions, self.tokenizer,
                                           template=cfg.data.template,
                                           max_prompt_tokens=cfg.data.max_prompt_tokens)
    if not prompts:
      raise ValueError(f"{path}: no usable questions ({len(loaded.skipped)} bad rows, "
                       f"{dropped} longer than data.max_prompt_tokens)")
    print(f"[exgrpo_jax] {path}: {len(prompts)} questions ({len(loaded.skipped)} bad rows "
          f"skipped, {dropped} prompts over {cfg.data.max_prompt_tokens} tokens dropped)",
          file=sys.stderr)
    return prompts, {"rows_skipped": len(loaded.skipped), "prompts_too_long": dropped}

  @classmethod
  def create_or_restore(cls, config, workdir: str) -> "RunState":
    state = cls(config, workdir)
    latest = state.store.latest_step()
    if latest is None:
      state.init_weights()
    else:
      state.restore(latest)
      print(f"[exgrpo_jax] resumed from {checkpointing.checkpoint_dir(workdir)}/{latest}",
            file=sys.stderr)
    return state

  def init_weights(self) -> None:
    """Initial params (random or `model.path`) and a fresh optimizer, created sharded."""
    if self.config.model.random_init:
      self.params = sharding.init_params(self.model_cfg, jax.random.key(self.config.train.seed),
                                         self.param_shardings)
    else:
      self.params = loading.load_params(self._hf_dir, self.model_cfg, self.param_shardings)
    self.opt_state = sharding.init_optimizer(self._tx, self.params, self.opt_shardings)

  # --- per-step helpers ---------------------------------------------------------------------

  def prompt_ids(self, uid: int) -> list[int]:
    return list(self._by_uid[uid].ids)

  def score(self, qids, k: int, texts: list[str]):
    """Rewards [len(qids) * k] for group-ordered `texts`, and the pool's stats.

    Every process grades; process 0's rewards are used everywhere, so a timeout on one
    host cannot make the processes' buffers diverge.
    """
    items = []
    for i, text in enumerate(texts):
      prompt = self._by_uid[qids[i // k]]
      items.append(rewards.RewardItem(text, prompt.question.ground_truth,
                                      prompt.question.reward_name, prompt.think_gate))
    rewards_N, stats = self.reward_pool.score(items)
    return distributed.from_primary(rewards_N), stats

  def evaluate(self, engine) -> dict:
    """Validation accuracy on `eval.path`, per data source and averaged (val/* metrics)."""
    cfg = self.config.eval
    if not cfg.path:
      return {}
    if self._eval_questions is None:
      self._eval_questions = data.load_questions(
          cfg.path, skip_bad_rows=self.config.data.skip_bad_rows, limit=cfg.limit,
          reward_name=self.config.reward.name).questions
    # Same template (system prompt included) and length limit as the training prompts.
    options = evaluation.EvalOptions(template=self.config.data.template, remove_system=False,
                                     max_prompt_tokens=self.config.data.max_prompt_tokens,
                                     n=cfg.n)
    result = evaluation.evaluate(
        engine, self.params, self.tokenizer, self._eval_questions,
        sampling.SamplingConfig(temperature=cfg.temperature, greedy=cfg.temperature == 0,
                                max_new_tokens=cfg.max_new_tokens),
        self.reward_pool, jax.random.key(self.config.train.seed), options)
    metrics = {f"val/test_score/{src}": v["avg@k"] for src, v in result["per_source"].items()}
    metrics["val/avg_score"] = result["overall"]["avg@k"]
    metrics["val/response_length"] = result["overall"]["mean_response_length"]
    return metrics

  # --- checkpoints --------------------------------------------------------------------------

  def save(self) -> None:
    meta = dict(
        step=self.step, replay_started=self.replay_started,
        stream=self.stream.state_dict(),
        model_config=checkpointing.model_config_to_json(self.model_cfg),
        tokenizer_source=os.path.abspath(self.tokenizer_source)
        if os.path.exists(self.tokenizer_source) else self.tokenizer_source,
        config=self.config.to_dict())
    host = self.buffer.state_dict()
    self.check_host_state(host, meta)
    self.store.save(self.step, self.params, self.opt_state, host, meta)

  def check_host_state(self, host: dict, meta: dict) -> None:
    """Digest of the host state (buffer, stream, counters), checked equal on all processes."""
    scalars = {k: meta[k] for k in ("step", "replay_started", "stream")}
    hex_digest = distributed.digest(host, json.dumps(scalars, sort_keys=True, default=str))
    if jax.process_count() > 1:
      print(f"[exgrpo_jax] process {jax.process_index()}: host state digest {hex_digest} "
            f"at step {self.step}", file=sys.stderr)
    distributed.check_same_on_all_processes(hex_digest, f"host state at step {self.step}")

  def restore(self, step: int) -> None:
    """Loads checkpoint `step`; params and optimizer state are read into their shards."""
    params, opt, host, meta = self.store.restore(
        step, sharding.abstract(self.params, self.param_shardings),
        sharding.abstract(self.opt_state, self.opt_shardings))
    self.params, self.opt_state = params, opt
    self.buffer = buffer_lib.ExperienceBuffer.from_state_dict(host)
    self.stream.load_state_dict(meta["stream"])
    self.step = int(meta["step"])
    self.replay_started = bool(meta["replay_started"])

  def close(self) -> None:
    self.reward_pool.close()
    self.store.close()
