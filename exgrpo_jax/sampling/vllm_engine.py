"""The vLLM rollout engine (NVIDIA GPUs; vLLM >= 0.10.2 is an optional dependency).

NOT RUN AGAINST A REAL vLLM: vLLM needs CUDA and cannot be installed where this project is
built. The engine is written to vLLM's documented API (`LLM`, `LLM.generate`,
`LLM.collective_rpc`, `LLM.sleep(level=)`, `LLM.wake_up(tags=)`, `SamplingParams`) and
tested through a stand-in `vllm` module that implements only those calls and records them
(tests/vllm_stand_in.py); `tests/sampling_vllm_test.py` runs the real end-to-end test
where `import vllm` works and a CUDA GPU is present.

Options, GPU memory split and process layout: see `vllm_setup` (the `rollout.vllm`
config section; one JAX process per GPU, TRL's colocate pattern).

Weights: vLLM starts with `load_format="dummy"` (a directory with config.json and the
tokenizer is enough). Whenever `generate` gets parameters it has not loaded (and after
every sleep), each tensor is made on the device: its layer sliced from our stacked axis,
cast to the compute dtype, laid out as Hugging Face's through the export's name map
(`models.hf_keys`), gathered whole onto this process's GPU, and handed to torch by
DLPack, without a copy or a trip through the host. Chunks of about 1 GiB go to the
model's own `load_weights` inside the worker, through `LLM.collective_rpc`; the worker
lives in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0; the external launcher across
processes), so tensors are passed by reference.

Sleep (`rollout.vllm.sleep_level` > 0): every `generate` call ends with `LLM.sleep`, so
every JAX phase (trajectory selection, old log-probs, the learner, evaluation scoring)
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

import functools
import importlib.util
import json
import os
import tempfile
import weakref

import jax
import numpy as np
from jax.experimental import multihost_utils

from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import hf_keys
from exgrpo_jax.sampling import base
from exgrpo_jax.sampling import outputs
from exgrpo_jax.sampling import vllm_setup

# Bytes of converted tensors per load_weights call: bounds the extra device memory.
_LOAD_CHUNK_BYTES = 1 << 30


def check_available() -> None:
  """Raises a clear error if vLLM cannot run here (not installed, or no CUDA GPU)."""
  if importlib.util.find_spec("vllm") is None:
    raise ImportError(
        "rollout engine 'vllm' needs the vllm package, which is not installed "
        "(pip install -e '.[vllm]'; it requires an NVIDIA GPU with CUDA). Use engine 'jax' "
        "instead.")
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError("rollout engine 'vllm' needs PyTorch (a vllm dependency)") from None
  if not torch.cuda.is_available():
    raise RuntimeError(
        "rollout engine 'vllm' needs an NVIDIA GPU with CUDA, but torch sees none "
        "(torch.cuda.is_available() is False). Use engine 'jax' instead.")


def _device_bytes(local_rank: int) -> int:
  import torch  # pylint: disable=g-import-not-at-top
  return torch.cuda.get_device_properties(local_rank).total_memory


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
  """Yields (HF name, whole single-device jax.Array in `dtype`) for every tensor."""
  for template, path, layout in hf_keys.key_table(cfg):
    leaf = params
    for key in path:
      leaf = leaf[key]
    convert = _converter(_whole_on_this_process(leaf), layout, dtype, "{i}" in template)
    for layer, name in enumerate(hf_keys.hf_names(template, cfg.num_layers)):
      yield name, convert(leaf, np.int32(layer)).addressable_shards[0].data


def weight_chunks(cfg: config_lib.ModelConfig, params, dtype: str,
                  max_bytes: int = _LOAD_CHUNK_BYTES):
  """Lists of (HF name, torch tensor sharing the jax array's memory), ~max_bytes each."""
  import torch  # pylint: disable=g-import-not-at-top
  chunk, size = [], 0
  for name, array in hf_device_tensors(cfg, params, dtype):
    if chunk and size + array.nbytes > max_bytes:
      yield chunk
      chunk, size = [], 0
    # DLPack makes torch's stream wait for JAX's computation of the array.
    chunk.append((name, torch.from_dlpack(array)))
    size += array.nbytes
  if chunk:
    yield chunk


def sampling_params_kwargs(sampling: base.SamplingConfig, count: int, seed: int,
                           eos_ids: tuple[int, ...], ignore_eos: bool = False) -> dict:
  """vLLM `SamplingParams` arguments for one prompt's `count` samples."""
  return dict(
      n=count, temperature=0.0 if sampling.is_greedy else sampling.temperature,
      top_p=sampling.top_p, top_k=sampling.top_k if sampling.top_k > 0 else -1,
      max_tokens=sampling.max_new_tokens, logprobs=0, seed=seed,
      stop=list(sampling.stop_strings) or None, ignore_eos=ignore_eos,
      stop_token_ids=[] if ignore_eos else list(eos_ids),
      include_stop_str_in_output=True, skip_special_tokens=True)


def raw_rows(request_outputs, counts, max_new_tokens: int, eos_ids, pad_id: int,
             first_prompt: int = 0) -> dict:
  """vLLM `RequestOutput`s (one per prompt with a count > 0, in order) as padded arrays."""
  live = [first_prompt + i for i, c in enumerate(counts) if c > 0]
  if len(request_outputs) != len(live):
    raise ValueError(f"vLLM returned {len(request_outputs)} outputs for {len(live)} prompts")
  rows = [(i, c) for i, r in zip(live, request_outputs) for c in r.outputs]
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


def _load_weights(worker, weights):
  """Runs inside the vLLM worker: the model maps HF names onto its fused parameters."""
  worker.model_runner.model.load_weights(weights=weights)


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

  def __init__(self, model_cfg, tokenizer, options: vllm_setup.VllmOptions | None = None,
               ignore_eos: bool = False, **llm_kwargs):
    check_available()
    if tokenizer is None:
      raise ValueError("the vllm engine needs the tokenizer")
    options = options or vllm_setup.VllmOptions(model_cfg.max_position_embeddings)
    lines = options.problems()
    if lines:
      raise ValueError("\n".join(lines))
    self.layout = vllm_setup.ProcessLayout.create(
        options.tensor_parallel_size, jax.process_index(), jax.process_count(),
        jax.local_device_count())
    device = jax.local_devices()[0]
    local_rank = device.local_hardware_id if device.platform == "gpu" else 0
    jax_fraction = vllm_setup.jax_held_fraction() if device.platform == "gpu" else None
    self.memory = vllm_setup.plan_split(model_cfg, options, _device_bytes(local_rank),
                                        jax_fraction)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if self.layout.processes > 1:
      for name, value in vllm_setup.launcher_env(self.layout, local_rank).items():
        os.environ.setdefault(name, value)
      llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
    import vllm  # pylint: disable=g-import-not-at-top
    self._vllm = vllm
    self.model_cfg, self.tokenizer, self.options = model_cfg, tokenizer, options
    self.eos_ids = base.eos_ids(model_cfg, tokenizer)
    self.pad_id = base.pad_id(model_cfg, tokenizer)
    self.ignore_eos = ignore_eos
    self._dir = tempfile.TemporaryDirectory(prefix="exgrpo_vllm_")
    with open(os.path.join(self._dir.name, "config.json"), "w") as f:
      json.dump(config_lib.to_hf_config(model_cfg, torch_dtype=model_cfg.param_dtype), f)
    tokenizer.save_pretrained(self._dir.name)
    # A tensor-parallel group must sample alike, so its ranks share the seed.
    self.llm = vllm.LLM(model=self._dir.name, load_format="dummy", dtype=model_cfg.dtype,
                        seed=options.seed + self.layout.group,
                        logprobs_mode="processed_logprobs",
                        **options.llm_kwargs(), **llm_kwargs)
    self._loaded = []
    self._asleep = False

  def _is_loaded(self, params) -> bool:
    leaves = jax.tree.leaves(params)
    return len(leaves) == len(self._loaded) and all(
        ref() is leaf for ref, leaf in zip(self._loaded, leaves))

  def update_weights(self, params) -> None:
    """Loads `params` into vLLM's model (on the device, compute dtype)."""
    for chunk in weight_chunks(self.model_cfg, params, self.model_cfg.dtype):
      self.llm.collective_rpc(_load_weights, args=(chunk,))
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
