"""The rollout interface the trainer codes against, shared by the JAX and vLLM engines.

  engine = sampling.make_engine("jax", model_cfg, tokenizer)
  out = engine.generate(prompt_ids, n=[8, 7, 8], params=params, key=key,
                        sampling=sampling.SamplingConfig(max_new_tokens=512))
  out.tokens_NxT, out.mask_NxT, out.logprobs_NxT     # rows prompt-major

`n` is an int (every prompt gets n samples) or one count per prompt (ExGRPO: K for fresh
questions, K-1 for replayed ones; a count of 0 skips the prompt). Either way it is one
call and one batch. Rows are prompt-major: prompt i's samples are contiguous and
`prompt_index_N` says which prompt a row belongs to.
"""

import dataclasses
from typing import Protocol, Sequence

import jax
import numpy as np

from exgrpo_jax import registry

ENGINES = registry.Registry("rollout engine")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to sample. `temperature=0` or `greedy=True` means argmax decoding.

  Log-probs are always those of the temperature-scaled full distribution,
  log_softmax(logits / T)[token], before top-k/top-p truncation (T = 1 when greedy with
  T = 0); see `exgrpo_jax.sampling.categorical` for the exact definitions.
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0  # 0 = off
  greedy: bool = False
  max_new_tokens: int = 256
  # A response ends with the token that completes the first occurrence of any of these
  # in its decoded text; `texts` end right after the stop string.
  stop_strings: tuple[str, ...] = ()
  return_entropy: bool = False

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 = off), got {self.top_k}")
    if self.max_new_tokens < 1:
      raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if isinstance(self.stop_strings, str) or any(
        not isinstance(s, str) or not s for s in self.stop_strings):
      raise ValueError("SamplingConfig.stop_strings must be a tuple of non-empty strings, "
                       f"got {self.stop_strings!r}")

  @classmethod
  def for_rollout(cls, rollout) -> "SamplingConfig":
    """The training rollouts' settings: a config's `rollout` section."""
    return cls(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
               max_new_tokens=rollout.max_new_tokens)

  @property
  def is_greedy(self) -> bool:
    return self.greedy or self.temperature == 0

  def program_options(self) -> dict:
    """The static options the JAX sampler's decode programs take from these settings."""
    return dict(max_new_tokens=self.max_new_tokens,
                top_k=0 if self.is_greedy else self.top_k,
                use_top_p=not self.is_greedy and self.top_p < 1.0,
                return_entropy=self.return_entropy)


@dataclasses.dataclass
class RolloutOutput:
  """Host-side numpy results; N rows prompt-major, T = max_new_tokens columns."""

  tokens_NxT: np.ndarray  # int32 response ids, right-padded with the pad id
  mask_NxT: np.ndarray  # bool, True on response tokens up to and including EOS / stop
  logprobs_NxT: np.ndarray  # float32 log-probs of the sampled tokens, 0 on padding
  entropy_NxT: np.ndarray | None  # float32 full-vocabulary entropy, 0 on padding
  lengths_N: np.ndarray  # int32 number of response tokens
  truncated_N: np.ndarray  # bool, hit max_new_tokens without EOS / stop string
  texts: list[str]  # decoded responses, special tokens skipped
  prompt_index_N: np.ndarray  # int32, the prompt each row belongs to


class RolloutEngine(Protocol):
  """What the trainer needs from a generator."""

  def generate(self, prompt_ids: list[list[int]], n: int | Sequence[int], params,
               key: jax.Array, sampling: SamplingConfig) -> RolloutOutput:
    ...

  def update_weights(self, params) -> None:
    ...

  def close(self) -> None:
    """Releases what the engine holds; it cannot generate afterwards."""
    ...


def make_engine(name: str, model_cfg, tokenizer, **options) -> RolloutEngine:
  """Builds the engine registered as `name` ("jax" or "vllm")."""
  return ENGINES.get(name)(model_cfg, tokenizer, **options)


def sample_counts(prompt_ids: Sequence[Sequence[int]], n: int | Sequence[int]) -> np.ndarray:
  """Validates the prompts and `n`; returns the per-prompt sample counts (int64)."""
  if not isinstance(prompt_ids, Sequence) or isinstance(prompt_ids, (str, bytes)):
    raise TypeError(f"prompt_ids must be a list of token-id lists, got {type(prompt_ids)}")
  for i, ids in enumerate(prompt_ids):
    if len(ids) == 0:
      raise ValueError(f"prompt_ids[{i}] is empty; every prompt needs at least one token")
  if isinstance(n, (int, np.integer)):
    counts = np.full(len(prompt_ids), int(n), np.int64)
  else:
    counts = np.asarray(list(n), np.int64)
    if counts.shape != (len(prompt_ids),):
      raise ValueError(f"n has {counts.size} counts for {len(prompt_ids)} prompts")
  if (counts < 0).any():
    raise ValueError(f"sample counts must be >= 0, got n[{int(np.argmin(counts))}] = "
                     f"{int(counts.min())}")
  return counts


def eos_ids(model_cfg, tokenizer) -> tuple[int, ...]:
  """Every id that ends a response: the config's EOS ids and the tokenizer's."""
  ids = set(model_cfg.eos_token_id)
  if tokenizer is not None and tokenizer.eos_token_id is not None:
    ids.add(int(tokenizer.eos_token_id))
  if not ids:
    raise ValueError("no EOS id: neither the model config nor the tokenizer defines one")
  return tuple(sorted(ids))


def pad_id(model_cfg, tokenizer) -> int:
  """The id written after a response ends (tokenizer pad, config pad, else first EOS)."""
  if tokenizer is not None and tokenizer.pad_token_id is not None:
    return int(tokenizer.pad_token_id)
  if model_cfg.pad_token_id is not None:
    return int(model_cfg.pad_token_id)
  return eos_ids(model_cfg, tokenizer)[0]
