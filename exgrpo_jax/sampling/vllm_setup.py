"""How the vLLM engine is configured and laid out: options, memory split, processes.

Options (`VllmOptions.from_config`): the `rollout.vllm` config section, checked at
start-up with one line per bad value, plus two derived values: `max_model_len` is the
prompt budget (`data.max_prompt_tokens`) plus the longest response the run asks for
(`rollout.max_new_tokens`, or `eval.max_new_tokens` when evaluation runs and is longer),
and the engine seed is `train.seed`.

Memory (`plan_split`): JAX and vLLM share each GPU. JAX's default allocator keeps what
it has taken for the whole run (it preallocates `XLA_PYTHON_CLIENT_MEM_FRACTION`, 0.75 by
default, or with `XLA_PYTHON_CLIENT_PREALLOCATE=false` grows up to it and never gives
back), so the two fractions must fit side by side. Only
`XLA_PYTHON_CLIENT_ALLOCATOR=platform` returns JAX's freed memory to the GPU; with it, the
memory vLLM releases while it sleeps (`rollout.vllm.sleep_level`) is what the learner
uses. Either way vLLM's share must hold its weights, a working allowance and the KV
cache of at least one `max_model_len` sequence, or vLLM refuses to start.

vLLM's CPU build (`plan_cpu_kv`) has no GPU fraction and no sleep mode: its KV cache is
an explicit size in host memory, vLLM's own `VLLM_CPU_KVCACHE_SPACE` (GiB) where set, else
room for `max_num_seqs` full-length sequences, capped at a quarter of the host memory
available at start-up (vLLM's automatic size subtracts the whole process's resident
memory, JAX's included, from its share, so it is not used).

Processes (`ProcessLayout`, `split_prompts`): TRL's colocate pattern. One JAX process
per GPU (jax.distributed); every process owns one vLLM rank on its GPU. With
`tensor_parallel_size` 1 each process runs a vLLM of its own; otherwise groups of that
many consecutive processes, on one node, form one vLLM (vLLM's "external_launcher"
backend, a torch.distributed world per group). Every process knows the whole step's prompts (the
host side is replicated, see `exgrpo_jax.distributed`); each group generates a
contiguous slice of them, balanced by rows, and the slices are gathered back in order.
"""

import dataclasses
import os

import numpy as np

from exgrpo_jax import cli
from exgrpo_jax.models import config as config_lib

GIB = 2 ** 30
# JAX's share plus vLLM's: the rest is CUDA contexts, NCCL and the torch allocator.
MAX_TOTAL_FRACTION = 0.95
# vLLM's own temporaries next to weights and KV cache (profiling-run activations, the
# sampler's logits, CUDA graphs): a rough allowance, not a measured figure.
WORKING_BYTES = 2 * GIB
# vLLM's CPU build: at most this share of the host's available memory for the KV cache.
CPU_KV_SHARE = 0.25
CPU_BLOCK_TOKENS = 128  # vLLM's KV block on CPU (tokens)
SLEEP_LEVELS = (0, 1, 2)  # 0 = never sleep; 1 = weights to CPU; 2 = weights discarded
VLLM_DTYPES = ("", "float32", "bfloat16", "float16")  # "" = the model's (model.dtype)


@dataclasses.dataclass(frozen=True)
class VllmOptions:
  """What `vllm.LLM` is built with (see the `rollout.vllm` section of configs/common.py)."""

  max_model_len: int
  gpu_memory_utilization: float = 0.3
  tensor_parallel_size: int = 1
  sleep_level: int = 2
  max_num_seqs: int = 256
  enforce_eager: bool = False
  dtype: str = ""  # vLLM's compute dtype; "" = the model's (model.dtype)
  seed: int = 0

  def problems(self) -> list[str]:
    """One line per bad value (empty when all are usable)."""
    lines = []

    def bad(key, allowed):
      lines.append(f"config.rollout.vllm.{key}={getattr(self, key)!r}: {allowed}")

    def is_int(v):
      return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    u = self.gpu_memory_utilization
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u < 1:
      bad("gpu_memory_utilization", "must be a fraction of the GPU in (0, 1)")
    for key in ("tensor_parallel_size", "max_num_seqs"):
      if not is_int(getattr(self, key)) or getattr(self, key) < 1:
        bad(key, "must be an integer >= 1")
    if self.sleep_level not in SLEEP_LEVELS or not is_int(self.sleep_level):
      bad("sleep_level", "must be 0 (never sleep), 1 (weights to CPU) or 2 (weights "
          "discarded, reloaded from JAX)")
    if not isinstance(self.enforce_eager, bool):
      bad("enforce_eager", "must be True or False")
    if self.dtype not in VLLM_DTYPES:
      bad("dtype", f"must be one of {VLLM_DTYPES} (\"\": the model's, model.dtype)")
    if not is_int(self.max_model_len) or self.max_model_len < 2:
      lines.append(f"max_model_len={self.max_model_len!r} (data.max_prompt_tokens + "
                   "max_new_tokens) must be an integer >= 2")
    return lines

  @classmethod
  def from_config(cls, config) -> "VllmOptions":
    """The options of training config `config`; ValueError lists every bad value."""
    v, new_tokens = config.rollout.vllm, config.rollout.max_new_tokens
    if config.eval.every or config.eval.before_train:
      new_tokens = max(new_tokens, config.eval.max_new_tokens)
    options = cls(max_model_len=config.data.max_prompt_tokens + new_tokens,
                  seed=config.train.seed, **v.to_dict())
    lines = options.problems()
    if lines:
      raise ValueError("\n".join(lines))
    return options

  def llm_kwargs(self) -> dict:
    """The `vllm.LLM` keyword arguments these options set."""
    return dict(gpu_memory_utilization=self.gpu_memory_utilization,
                tensor_parallel_size=self.tensor_parallel_size,
                max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                enforce_eager=self.enforce_eager, enable_sleep_mode=self.sleep_level > 0)


# --- GPU memory ----------------------------------------------------------------------------

def jax_held_fraction(environ=os.environ) -> float | None:
  """The GPU fraction JAX keeps for the run; None if it returns freed memory."""
  if environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
    return None
  fraction = environ.get("XLA_CLIENT_MEM_FRACTION") or environ.get(
      "XLA_PYTHON_CLIENT_MEM_FRACTION") or "0.75"
  return float(fraction)


@dataclasses.dataclass(frozen=True)
class MemorySplit:
  """One GPU's memory under a JAX / vLLM split, in GiB."""

  device_gib: float
  jax_fraction: float | None  # None: JAX returns freed memory (platform allocator)
  vllm_fraction: float
  vllm_weights_gib: float  # this rank's share of the weights, compute dtype
  kv_gib_per_sequence: float  # one max_model_len sequence, this rank's KV heads
  kv_sequences: int  # full-length sequences the rest of vLLM's share holds
  kv_cache_bytes: int | None = None  # vLLM's CPU build: its KV cache, set explicitly


def plan_split(model_cfg: config_lib.ModelConfig, options: VllmOptions, device_bytes: int,
               jax_fraction: float | None) -> MemorySplit:
  """The split of one GPU; ValueError (one line) when it cannot work."""
  u, tp = options.gpu_memory_utilization, options.tensor_parallel_size
  if jax_fraction is not None and round(jax_fraction + u, 6) > MAX_TOTAL_FRACTION:
    raise ValueError(
        f"JAX keeps {jax_fraction:.2f} of each GPU (XLA_PYTHON_CLIENT_MEM_FRACTION) and "
        f"rollout.vllm.gpu_memory_utilization={u:.2f} asks for {u:.2f} more: "
        f"{jax_fraction + u:.2f} > {MAX_TOTAL_FRACTION}; lower one of them, or set "
        "XLA_PYTHON_CLIENT_ALLOCATOR=platform so the learner uses what vLLM frees while it "
        "sleeps (docs/vllm.md, 'Sleep and memory')")
  weights, kv_seq = _weight_and_sequence_bytes(model_cfg, options)
  free = u * device_bytes - weights - WORKING_BYTES
  if free < kv_seq:
    raise ValueError(
        f"rollout.vllm.gpu_memory_utilization={u:.2f} gives vLLM {u * device_bytes / GIB:.1f}"
        f" GiB of the {device_bytes / GIB:.1f} GiB GPU, less than its weights "
        f"({weights / GIB:.1f} GiB at tensor_parallel_size={tp}) + {WORKING_BYTES / GIB:.0f}"
        f" GiB working memory + one {options.max_model_len}-token sequence of KV cache "
        f"({kv_seq / GIB:.2f} GiB); raise it, or rollout.vllm.tensor_parallel_size")
  return MemorySplit(device_gib=device_bytes / GIB, jax_fraction=jax_fraction,
                     vllm_fraction=u, vllm_weights_gib=weights / GIB,
                     kv_gib_per_sequence=kv_seq / GIB, kv_sequences=int(free // kv_seq))


def _weight_and_sequence_bytes(model_cfg: config_lib.ModelConfig,
                               options: VllmOptions) -> tuple[float, int]:
  """One rank's weights and KV cache of one max_model_len sequence, compute dtype."""
  itemsize = np.dtype(config_lib.dtype_from_name(model_cfg.dtype)).itemsize
  tp = options.tensor_parallel_size
  kv_heads = -(-model_cfg.num_kv_heads // tp)  # vLLM replicates KV heads when tp > K
  kv_seq = (2 * model_cfg.num_layers * kv_heads * model_cfg.head_dim
            * options.max_model_len * itemsize)
  return model_cfg.num_params() * itemsize / tp, kv_seq


def plan_cpu_kv(model_cfg: config_lib.ModelConfig, options: VllmOptions,
                available_bytes: int, environ=os.environ) -> MemorySplit:
  """vLLM's CPU build: the KV cache size in host memory; ValueError (one line) if short."""
  weights, kv_seq = _weight_and_sequence_bytes(model_cfg, options)
  # vLLM gives a sequence whole blocks (max_model_len rounded up to the CPU block) and
  # keeps one block of the cache for itself (its null block).
  block = kv_seq // options.max_model_len * CPU_BLOCK_TOKENS
  kv_seq = -(-options.max_model_len // CPU_BLOCK_TOKENS) * block
  space = environ.get("VLLM_CPU_KVCACHE_SPACE", "")
  if space:
    if not space.isdigit():
      raise ValueError(f"VLLM_CPU_KVCACHE_SPACE={space!r} must be a whole number of GiB")
    kv_bytes, source = int(space) * GIB, f"VLLM_CPU_KVCACHE_SPACE={space}"
  else:
    kv_bytes = block + int(min(options.max_num_seqs * kv_seq, CPU_KV_SHARE * available_bytes))
    source = (f"a quarter of the {available_bytes / GIB:.1f} GiB of host memory available"
              " (set VLLM_CPU_KVCACHE_SPACE=<GiB> to choose)")
  if kv_bytes - block < kv_seq:
    raise ValueError(
        f"vLLM's CPU KV cache from {source} is {kv_bytes / GIB:.2f} GiB, less than one "
        f"{options.max_model_len}-token sequence ({kv_seq / GIB:.2f} GiB) and vLLM's own "
        "block; " + ("raise VLLM_CPU_KVCACHE_SPACE or unset it (then a quarter of the "
                     "available memory is used)" if space else
                     "free memory or shorten data.max_prompt_tokens / max_new_tokens"))
  return MemorySplit(device_gib=available_bytes / GIB, jax_fraction=None,
                     vllm_fraction=kv_bytes / available_bytes,
                     vllm_weights_gib=weights / GIB, kv_gib_per_sequence=kv_seq / GIB,
                     kv_sequences=int((kv_bytes - block) // kv_seq), kv_cache_bytes=kv_bytes)


# --- processes -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ProcessLayout:
  """This JAX process's place among the vLLM instances (groups of tp processes)."""

  process: int
  processes: int
  tensor_parallel_size: int

  @classmethod
  def create(cls, tensor_parallel_size: int, process: int, processes: int,
             local_devices: int) -> "ProcessLayout":
    tp = tensor_parallel_size
    # Config values this launch cannot run (exit status 2); the next is how it was started.
    if processes == 1 and tp > 1:
      raise cli.UsageError(
          f"rollout.vllm.tensor_parallel_size={tp} needs {tp} JAX processes, one per GPU "
          "(jax.distributed; docs/vllm.md, 'Every GPU rolls out'); this run has 1")
    if processes % tp:
      raise cli.UsageError(f"rollout.vllm.tensor_parallel_size={tp} does not divide the "
                       f"{processes} JAX processes")
    if processes > 1 and local_devices != 1:
      raise ValueError(
          f"vLLM rollouts over {processes} JAX processes need one GPU per process, but "
          f"process {process} has {local_devices} local devices; start one process per "
          "GPU (docs/vllm.md, 'Every GPU rolls out')")
    return cls(process, processes, tp)

  @property
  def group(self) -> int:
    return self.process // self.tensor_parallel_size

  @property
  def num_groups(self) -> int:
    return self.processes // self.tensor_parallel_size

  def leader(self, group: int) -> int:
    """The process whose outputs stand for `group`'s (all its ranks return the same)."""
    return group * self.tensor_parallel_size


def split_prompts(counts: np.ndarray, groups: int) -> list[tuple[int, int]]:
  """Contiguous [start, end) prompt ranges, one per group, balanced by rows (samples)."""
  counts = np.asarray(counts, np.int64)
  total = int(counts.sum())
  if total == 0:
    return [(0, len(counts))] + [(len(counts), len(counts))] * (groups - 1)
  middle = np.cumsum(counts) - counts / 2  # a prompt goes where its rows' middle falls
  group_N = np.minimum((middle * groups / total).astype(np.int64), groups - 1)
  bounds = np.searchsorted(group_N, np.arange(groups + 1), side="left")
  bounds[-1] = len(counts)
  return [(int(bounds[g]), int(bounds[g + 1])) for g in range(groups)]


def launcher_env(layout: ProcessLayout, local_rank: int, environ=os.environ) -> dict:
  """torch.distributed variables for vLLM's external launcher: one world per group.

  vLLM's world is its instance (tensor_parallel_size ranks), not the JAX run: with every
  process in one world, ranks past the first group are refused. A group rendezvous on
  its node at port MASTER_PORT (else the JAX coordinator's port + 1) plus its index.
  """
  port = environ.get("MASTER_PORT", "")
  if not port:
    _, _, jax_port = environ.get("JAX_COORDINATOR_ADDRESS", "").rpartition(":")
    if not jax_port.isdigit():
      raise ValueError("vLLM with tensor_parallel_size > 1 needs MASTER_PORT "
                       "(torch.distributed) or JAX_COORDINATOR_ADDRESS=host:port to derive "
                       "it from")
    port = str(int(jax_port) + 1)
  return dict(RANK=str(layout.process % layout.tensor_parallel_size),
              WORLD_SIZE=str(layout.tensor_parallel_size), LOCAL_RANK=str(local_rank),
              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(int(port) + layout.group))


def max_rows(counts: np.ndarray, ranges: list[tuple[int, int]]) -> int:
  """The most rows any group generates (the padded size of the gather)."""
  return max(int(np.sum(counts[a:b])) for a, b in ranges)
