"""A `.gguf` checkpoint (llama or qwen2) as a float32 Hugging Face directory, without PyTorch.

* weights: `gguf.dequantize` (llama.cpp's NumPy reader) gives every tensor in float32 in
  HF's [out, in] layout; llama's q/k rows, which llama.cpp's converter interleaves for its
  RoPE kernel, are put back in HF order; names map to HF's.
* config.json: from the file's `<arch>.*` and `tokenizer.ggml.*` metadata.
* tokenizer: the vocabulary, merges and special tokens handed to transformers' own GGUF
  tokenizer builder (it needs `tokenizers` only; transformers' GGUF model and config
  readers need PyTorch, which is why they are not used).

`tests/gguf_test.py` checks the result bit for bit against transformers' PyTorch path.
"""

import json
import os
import re

import gguf
import numpy as np

from exgrpo_jax.models import safetensors_io

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
_IN_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# tokenizer.ggml.<key> -> the tokenizer config's special token (transformers' names).
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                   "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def _metadata(reader: gguf.GGUFReader) -> dict:
  return {name: field.contents() for name, field in reader.fields.items()}


def hf_config(meta: dict, tensor_names, path: str) -> dict:
  """A transformers config dict (LlamaForCausalLM / Qwen2ForCausalLM) from GGUF metadata."""
  arch = meta["general.architecture"]
  if arch not in ARCHITECTURES:
    raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported "
                     f"(supported: {', '.join(ARCHITECTURES)})")
  if "rope_freqs.weight" in tensor_names or f"{arch}.rope.scaling.type" in meta:
    raise ValueError(f"{path}: GGUF RoPE scaling is not supported; convert the original "
                     "Hugging Face checkpoint instead")

  def key(name, default=None):
    return meta.get(f"{arch}.{name}", default)

  heads, hidden = key("attention.head_count"), key("embedding_length")
  return dict(
      model_type=arch, architectures=[ARCHITECTURES[arch]],
      vocab_size=len(meta["tokenizer.ggml.tokens"]),
      hidden_size=hidden, intermediate_size=key("feed_forward_length"),
      num_hidden_layers=key("block_count"), num_attention_heads=heads,
      num_key_value_heads=key("attention.head_count_kv", heads),
      head_dim=key("rope.dimension_count", hidden // heads),
      rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
      rope_theta=key("rope.freq_base", 10000.0),
      max_position_embeddings=key("context_length"),
      tie_word_embeddings="output.weight" not in tensor_names,
      attention_bias=any(n.endswith("attn_q.bias") for n in tensor_names),
      bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
      pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
      torch_dtype="float32")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undoes llama.cpp's per-head interleaving of the rotary halves of q/k rows."""
  return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def hf_tensors(reader: gguf.GGUFReader, config: dict):
  """Yields (HF name, float32 array) for every tensor of the file."""
  for tensor in reader.tensors:
    weights = np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), np.float32)
    block = _BLOCK.fullmatch(tensor.name)
    if block:
      layer, kind, suffix = block.groups()
      if kind not in _IN_BLOCK:
        raise ValueError(f"unexpected GGUF tensor {tensor.name}")
      if config["model_type"] == "llama" and kind in ("attn_q", "attn_k"):
        heads = config["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"]
        weights = _unpermute(weights, heads)
      yield f"model.layers.{layer}.{_IN_BLOCK[kind]}.{suffix}", weights
    else:
      base, suffix = tensor.name.rsplit(".", 1)
      if base not in _TOP_LEVEL:
        raise ValueError(f"unexpected GGUF tensor {tensor.name}")
      yield f"{_TOP_LEVEL[base]}.{suffix}", weights


def import_transformers():
  """transformers, without its import-time notice that PyTorch is absent (it is not needed)."""
  os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
  import transformers  # pylint: disable=g-import-not-at-top
  return transformers


def _tokenizer_mapping():
  """transformers' GGUF tokenizer tables (5.18 on; 5.17, on the GPU image, lacks them)."""
  transformers = import_transformers()
  from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping  # pylint: disable=g-import-not-at-top
  if not hasattr(mapping, "GGUF_TOKENIZER_MAPPING"):
    raise ImportError(f"building a GGUF file's tokenizer needs transformers>=5.18, not "
                      f"{transformers.__version__}: pip install 'transformers>=5.18'")
  return transformers, mapping


def save_tokenizer(meta: dict, directory: str) -> None:
  """The file's tokenizer, built as transformers builds it from a GGUF, saved to `directory`."""
  transformers, mapping = _tokenizer_mapping()
  groups = {group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items()
                    if f"tokenizer.{key}" in meta}
            for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()}
  tokenizer_dict, tokenizer_config = groups["tokenizer"], groups["tokenizer_config"]
  if tokenizer_dict.get("tokenizer_type") == "llama":
    tokenizer_config.setdefault("add_bos_token", True)  # as transformers' GGUF reader does
  for name, key in _SPECIAL_TOKENS.items():
    token_id = meta.get(f"tokenizer.ggml.{key}")
    tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
  backend, extra = mapping.convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
  tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend,
                                                   **tokenizer_config, **extra)
  tokenizer.save_pretrained(directory)


GGUF_MAGIC = b"GGUF"


def _reader(gguf_path: str) -> gguf.GGUFReader:
  """gguf's reader, once the file is known to be a GGUF (its own error for another file
  reads the first bytes as a version number and names neither the file nor the cause)."""
  with open(gguf_path, "rb") as f:
    head = f.read(len(GGUF_MAGIC))
  if head != GGUF_MAGIC:
    raise ValueError(f"{gguf_path}: not a GGUF file (it starts with {head!r}, a GGUF file "
                     f"with {GGUF_MAGIC!r})")
  try:
    return gguf.GGUFReader(gguf_path)
  except (ValueError, IndexError, OSError) as e:
    raise ValueError(f"{gguf_path}: unreadable GGUF file ({e})") from None


def convert(gguf_path: str, directory: str) -> None:
  """Writes config.json, model.safetensors and the tokenizer of `gguf_path` to `directory`."""
  _tokenizer_mapping()  # before anything is written
  reader = _reader(gguf_path)
  meta = _metadata(reader)
  config = hf_config(meta, {t.name for t in reader.tensors}, gguf_path)
  os.makedirs(directory, exist_ok=True)
  safetensors_io.save_file(dict(hf_tensors(reader, config)),
                           os.path.join(directory, "model.safetensors"))
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  save_tokenizer(meta, directory)
