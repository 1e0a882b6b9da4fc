"""Everything a run carries between steps, built fresh or restored from a checkpoint.

Resume order: (1) the latest checkpoint in `<workdir>/checkpoints` (params, optimizer,
step, buffer, data stream, delayed-start flag; PRNG keys are derived from the seed and
the step, so they need no storage); (2) `config.model.path` (or random weights for
`model.random_init`) with a fresh optimizer, buffer and stream.
"""

import functools
import os
import sys

import jax

from exgrpo_jax import checkpointing
from exgrpo_jax import data
from exgrpo_jax import evaluation
from exgrpo_jax import models
from exgrpo_jax import rewards
from exgrpo_jax import sampling
from exgrpo_jax.replay import buffer as buffer_lib
from exgrpo_jax.training import learner


def _model_config_for_random_init(config, tokenizer) -> models.ModelConfig:
  return models.ModelConfig(
      vocab_size=len(tokenizer), eos_token_id=(tokenizer.eos_token_id,),
      pad_token_id=tokenizer.pad_token_id, dtype=config.model.dtype,
      param_dtype=config.model.param_dtype, remat=config.model.remat,
      **config.model.arch.to_dict())


class RunState:
  """Model, optimizer state, replay buffer, question stream, reward pool and counters."""

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
      self.params = models.init_params(self.model_cfg, jax.random.key(config.train.seed))
    else:
      policy = models.from_pretrained(m.path or None, dtype=m.dtype,
                                      param_dtype=m.param_dtype, remat=m.remat)
      self.model_cfg, self.params = policy.config, policy.params
    self.opt_state = learner.make_optimizer(config.optim).init(self.params)

    self.prompts, self.data_stats = self._load_prompts(config.data.train_path,
                                                       config.data.limit)
    self._by_uid = {p.question.uid: p for p in self.prompts}
    self.stream = data.QuestionStream([p.question for p in self.prompts],
                                      seed=config.train.seed)
    self.buffer = buffer_lib.ExperienceBuffer(
        dict(config.replay.to_dict(), vocab_size=self.model_cfg.vocab_size),
        seed=config.train.seed)
    self.reward_pool = rewards.RewardPool(num_workers=config.reward.num_workers,
                                          timeout_s=config.reward.timeout_s)
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
    if latest is not None:
      state.restore(latest)
      print(f"[exgrpo_jax] resumed from {checkpointing.checkpoint_dir(workdir)}/{latest}",
            file=sys.stderr)
    return state

  # --- per-step helpers ---------------------------------------------------------------------

  def prompt_ids(self, uid: int) -> list[int]:
    return list(self._by_uid[uid].ids)

  def score(self, qids, k: int, texts: list[str]):
    """Rewards [len(qids) * k] for group-ordered `texts`, and the pool's stats."""
    items = []
    for i, text in enumerate(texts):
      prompt = self._by_uid[qids[i // k]]
      items.append(rewards.RewardItem(text, prompt.question.ground_truth,
                                      prompt.question.reward_name, prompt.think_gate))
    return self.reward_pool.score(items)

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
    self.store.save(self.step, self.params, self.opt_state, self.buffer.state_dict(), meta)

  def restore(self, step: int) -> None:
    abstract = functools.partial(jax.tree.map, lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=getattr(x, "sharding", None)))
    params, opt, host, meta = self.store.restore(step, abstract(self.params),
                                                 abstract(self.opt_state))
    self.params, self.opt_state = params, opt
    self.buffer = buffer_lib.ExperienceBuffer.from_state_dict(host)
    self.stream.load_state_dict(meta["stream"])
    self.step = int(meta["step"])
    self.replay_started = bool(meta["replay_started"])

  def close(self) -> None:
    self.reward_pool.close()
    self.store.close()
