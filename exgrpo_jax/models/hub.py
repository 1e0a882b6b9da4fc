"""Models by hub id: a config's `model.hub_id`, fetched into the Hugging Face cache and
checked against the config.

  path = hub.download(hub_id)            # the files a run reads (huggingface_hub)
  path = hub.cached(hub_id)              # the cache's copy, or None (never the network)
  facts, problems = hub.verify(path, config)
  hub.use_cached(config)                 # model.path not on disk: the hub id's cached copy
  hub.config_problems(config)            # config_check: rope and positions, config.json only

The cache is huggingface_hub's (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub), so a
copy made with `hf download` is found as well. What a copy must match is the config.json
its hub id was published with (`published.for_hub_id`): architecture, sizes and rope
settings. A model the config does not expect (another rope_theta: LUFFY's 16k-context
Qwen2.5-Math-7B is the stock model with rope_theta 40000 instead of 10000) computes other
positions with the same weights, so it is refused rather than trained.
"""

import json
import os
import sys

from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import loading
from exgrpo_jax.models import published

# What a run reads: config.json, the safetensors weights and their index, the tokenizer
# and chat template. Not the PyTorch .bin/.pth copies some repositories hold as well.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer*"]
IGNORE_PATTERNS = ["original/*"]
# config.json fields a copy must share with the published config of its hub id.
_SIZES = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
          "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "tie_word_embeddings")
FETCH = "python -m exgrpo_jax.fetch"


def download(hub_id: str) -> str:
  """The snapshot directory of `hub_id` in the Hugging Face cache, downloaded as needed."""
  import huggingface_hub  # pylint: disable=g-import-not-at-top
  from huggingface_hub import errors  # pylint: disable=g-import-not-at-top
  try:
    return huggingface_hub.snapshot_download(hub_id, allow_patterns=ALLOW_PATTERNS,
                                             ignore_patterns=IGNORE_PATTERNS)
  except errors.GatedRepoError:
    raise PermissionError(f"{hub_id} is gated: accept its licence on "
                          f"https://huggingface.co/{hub_id}, then log in (`hf auth login`) "
                          "or set HF_TOKEN") from None
  except errors.RepositoryNotFoundError:
    raise FileNotFoundError(f"{hub_id}: no such model on the Hugging Face hub (or it is "
                            "private: log in or set HF_TOKEN)") from None
  except errors.LocalEntryNotFoundError:
    raise ConnectionError(f"{hub_id}: the hub cannot be reached and the Hugging Face cache "
                          f"({_cache_dir()}) holds no copy") from None


def cached(hub_id: str) -> str | None:
  """The snapshot directory of `hub_id` in the Hugging Face cache, or None."""
  import huggingface_hub  # pylint: disable=g-import-not-at-top
  from huggingface_hub import errors  # pylint: disable=g-import-not-at-top
  try:
    return huggingface_hub.snapshot_download(hub_id, local_files_only=True,
                                             allow_patterns=ALLOW_PATTERNS,
                                             ignore_patterns=IGNORE_PATTERNS)
  except errors.LocalEntryNotFoundError:
    return None


def _cache_dir() -> str:
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  return constants.HF_HUB_CACHE


def use_cached(config) -> str | None:
  """Points `model.path` at `model.hub_id`'s copy in the Hugging Face cache where
  model.path names nothing on disk; returns (and prints) the line saying so, or None."""
  m = config.model
  if not m.hub_id or not m.path or m.random_init or os.path.exists(m.path):
    return None
  found = cached(m.hub_id)
  if found is None:
    return None
  line = (f"[exgrpo_jax] model.path={m.path} is not on disk: reading model.hub_id="
          f"{m.hub_id} from the Hugging Face cache, {found}")
  m.path = found
  print(line, file=sys.stderr, flush=True)
  return line


def not_found(hub_id: str) -> str:
  """config_check's reason for a model.path that does not exist."""
  if not hub_id:
    return "no such file"
  return (f"no such file, and model.hub_id={hub_id!r} is not in the Hugging Face cache; "
          f"fetch it with `{FETCH}` and this config's flags (docs/data.md, \"Models\")")


def budgets(config) -> dict:
  """{key: new tokens} of each response budget a run of `config` decodes."""
  out = {"rollout.max_new_tokens": config.rollout.max_new_tokens}
  if config.eval.every or config.eval.before_train:
    out["eval.max_new_tokens"] = config.eval.max_new_tokens
  return out


def _rope(cfg: config_lib.ModelConfig) -> str:
  scaling = (f"rope_scaling {json.dumps(cfg.rope_scaling_dict)}" if cfg.rope_scaling
             else "no rope scaling")
  return f"rope_theta {cfg.rope_theta!r}, {scaling}"


def problems_of(hf: dict, config, where: str) -> list[str]:
  """One line per way the model of config.json `hf` (at `where`) cannot run `config`:
  rope settings other than its `model.hub_id` was published with, a response budget
  that leaves no room for a prompt in its positions."""
  m, lines = config.model, []
  cfg = config_lib.from_hf_config(hf)
  expected = published.for_hub_id(m.hub_id) if m.hub_id else None
  want = expected and config_lib.from_hf_config(expected)
  if want and (cfg.rope_theta, cfg.rope_scaling) != (want.rope_theta, want.rope_scaling):
    lines.append(
        f"config.model.path={where!r}: its config.json has {_rope(cfg)}; model.hub_id="
        f"{m.hub_id!r} was published with {_rope(want)}, so this is another model: point "
        f"model.path at that one (`{FETCH}` fetches it), or train this one as it is with "
        "--config.model.hub_id=")
  positions, prompt = cfg.max_position_embeddings, config.data.max_prompt_tokens
  for key, tokens in budgets(config).items():
    if tokens >= positions:
      lines.append(
          f"config.{key}={tokens}: leaves no room for a prompt in the {positions} positions "
          f"of model.path={where!r} (max_position_embeddings of its config.json); lower it "
          f"to {positions - prompt} ({positions} less data.max_prompt_tokens={prompt}), or "
          "use a model with more positions")
  return lines


def config_problems(config) -> list[str]:
  """`problems_of` the local HF directory at `model.path` (its config.json alone, read
  before anything loads); nothing for other models (.gguf, random weights, the
  embedded default), which the run checks once loaded."""
  m = config.model
  path = os.path.join(m.path, "config.json")
  if m.random_init or not m.path or not os.path.isfile(path):
    return []
  try:
    with open(path, encoding="utf-8") as f:
      return problems_of(json.load(f), config, m.path)
  except (OSError, KeyError, TypeError, ValueError):
    return []  # loading the model names what is wrong with its config.json


def verify(path: str, config) -> tuple[list[str], list[str]]:
  """(facts, problems) of the HF directory `path` as the model of `config`: its
  architecture and sizes against the published config of `model.hub_id`, its rope
  settings and positions (`problems_of`), its tokenizer, its weight files' tensors."""
  with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
    hf = json.load(f)
  cfg = loading.read_config(path)
  hub_id = config.model.hub_id
  expected = published.for_hub_id(hub_id) if hub_id else None
  architecture = config_lib.to_hf_config(cfg)["architectures"][0]
  facts = [f"{cfg.model_type} ({architecture}), {cfg.num_params() / 1e9:.2f}B parameters: "
           f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads "
           f"({cfg.num_kv_heads} KV), vocab {cfg.vocab_size}",
           f"{cfg.max_position_embeddings} positions, {_rope(cfg)}; the config's responses: "
           + ", ".join(f"{k} {v}" for k, v in budgets(config).items())]
  problems = []
  if architecture not in hf.get("architectures", [architecture]):
    problems.append(f"config.json: architectures {hf['architectures']}, expected "
                    f"{architecture} for model_type {cfg.model_type!r}")
  if expected is not None:
    problems += [f"config.json: {key} {hf.get(key)!r}, {hub_id} was published with "
                 f"{expected[key]!r}" for key in _SIZES if hf.get(key) != expected[key]]
  problems += problems_of(hf, config, path)
  try:
    tokenizer = loading.load_tokenizer(path)
    facts.append(f"tokenizer {type(tokenizer).__name__}, {len(tokenizer)} tokens, "
                 + ("a chat template" if tokenizer.chat_template else "no chat template"))
    if len(tokenizer) > cfg.vocab_size:
      problems.append(f"tokenizer: {len(tokenizer)} tokens, more than the model's "
                      f"vocab_size {cfg.vocab_size}")
  except Exception as e:  # pylint: disable=broad-except
    problems.append(f"tokenizer: does not load ({type(e).__name__}: {e})".splitlines()[0])
  try:
    file_of = loading.open_weights(path, cfg)
    files = len({f.path for f in file_of.values()})
    facts.append(f"weights: {files} safetensors file{'s' * (files > 1)}, {len(file_of)} "
                 "tensors, every one the model reads")
  except (OSError, ValueError) as e:
    problems.append(f"weights: {str(e).splitlines()[0]}")
  return facts, problems
