"""Rollout engines: the JAX KV-cache sampler (default) and vLLM (GPU, optional).

  engine = sampling.make_engine("jax", model_cfg, tokenizer)
  out = engine.generate(prompt_ids, n, params, key, sampling.SamplingConfig(...))
"""

from exgrpo_jax.sampling import jax_engine
from exgrpo_jax.sampling import vllm_engine
from exgrpo_jax.sampling.base import (ENGINES, RolloutEngine, RolloutOutput, SamplingConfig,
                                      make_engine)
from exgrpo_jax.sampling.jax_engine import SCHEDULERS
