"""Policy models: the Flax decoder, HF/GGUF weights in, HF weights out."""

from exgrpo_jax.models.config import ModelConfig, from_hf_config, matmul_precision, to_hf_config
from exgrpo_jax.models.export import save_pretrained
from exgrpo_jax.models.loading import (default_model_path, from_pretrained, load_tokenizer,
                                       resolve_hf_dir)
from exgrpo_jax.models.policy import (Policy, abstract_params, apply, init_params,
                                      logical_axes, param_shardings, unembedding)
from exgrpo_jax.models.transformer import KVCache
