"""The vLLM rollout engine (NVIDIA GPUs; vLLM is an optional dependency).

UNTESTED END TO END HERE: vLLM needs CUDA and cannot be installed in the project's
environments. What is tested without it: the parameter hand-off (names and layouts,
through `exgrpo_jax.models.export.hf_state_dict`), the request building and the
conversion of vLLM outputs into `RolloutOutput`; `tests/sampling_vllm_test.py` gates the
end-to-end test on `import vllm` and a CUDA GPU.

Weights: the engine starts vLLM with `load_format="dummy"` (nothing read from disk; a
directory holding only config.json and the tokenizer is enough) and, whenever
`generate` sees parameters it has not loaded yet (or on `update_weights`), streams them
in memory as (HF name, tensor) pairs into the model's own `load_weights`, called inside
the worker through `LLM.collective_rpc`. The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, set before vLLM is imported), so the tensors are
handed over by reference, never pickled or written to disk. Today each tensor makes one
device -> host -> device trip (`hf_state_dict` yields numpy arrays); a DLPack hand-off
would remove it.

GPU memory: JAX and vLLM share the GPU and each reserves memory up front.
  * JAX preallocates XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of the GPU when its
    backend starts; set it (or XLA_PYTHON_CLIENT_PREALLOCATE=false) before importing
    JAX, e.g. XLA_PYTHON_CLIENT_MEM_FRACTION=0.55 for the learner.
  * vLLM's `gpu_memory_utilization` (here default 0.3) is the fraction of the whole GPU
    it may use for weights, activations and KV cache; it must fit in what JAX left free.
  * Keep the two below ~0.9 together (CUDA contexts and the torch allocator need the
    rest). The engine refuses to start when JAX has preallocated and the sum exceeds
    0.95, instead of letting vLLM fail on a confusing out-of-memory error.

Log-probs: vLLM runs with `logprobs_mode="processed_logprobs"` (after temperature), which
is the JAX engine's log_softmax(logits / T) whenever top-k/top-p are off (the trainer's
setting); with them on, vLLM renormalises over the kept tokens, so its values are
higher than the JAX engine's by -log(kept mass). Greedy requests run at temperature 0,
for which vLLM reports log-probs at T = 1. Entropy is not available.
"""

import importlib.util
import json
import os
import tempfile
import weakref

import jax
import numpy as np

from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import export
from exgrpo_jax.sampling import base
from exgrpo_jax.sampling import outputs

# Tensors per load_weights call: bounds the host memory of one hand-off.
_LOAD_CHUNK_BYTES = 1 << 30


def check_available() -> None:
  """Raises a clear error if vLLM cannot run here (not installed, or no CUDA GPU)."""
  if importlib.util.find_spec("vllm") is None:
    raise ImportError(
        "rollout engine 'vllm' needs the vllm package, which is not installed "
        "(pip install vllm; it requires an NVIDIA GPU with CUDA). Use engine 'jax' instead.")
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError("rollout engine 'vllm' needs PyTorch (a vllm dependency)") from None
  if not torch.cuda.is_available():
    raise RuntimeError(
        "rollout engine 'vllm' needs an NVIDIA GPU with CUDA, but torch sees none "
        "(torch.cuda.is_available() is False). Use engine 'jax' instead.")


def check_memory_split(gpu_memory_utilization: float) -> None:
  """Refuses a JAX + vLLM memory split that cannot fit on one GPU."""
  if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() in ("false", "0"):
    return
  if not any(d.platform == "gpu" for d in jax.devices()):
    return
  jax_fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
  if jax_fraction + gpu_memory_utilization > 0.95:
    raise ValueError(
        f"JAX preallocates {jax_fraction:.2f} of the GPU (XLA_PYTHON_CLIENT_MEM_FRACTION) "
        f"and vLLM asks for gpu_memory_utilization={gpu_memory_utilization:.2f}; together "
        "they exceed 0.95. Lower one of them (set the environment variable before JAX "
        "starts) or set XLA_PYTHON_CLIENT_PREALLOCATE=false.")


def weight_chunks(cfg: config_lib.ModelConfig, params, max_bytes: int = _LOAD_CHUNK_BYTES):
  """Yields lists of (HF/vLLM name, float32 numpy array), at most ~max_bytes each."""
  chunk, size = [], 0
  for name, array in export.hf_state_dict(cfg, params, dtype="float32"):
    if chunk and size + array.nbytes > max_bytes:
      yield chunk
      chunk, size = [], 0
    chunk.append((name, array))
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


def to_rollout(request_outputs, counts, sampling: base.SamplingConfig, eos_ids, tokenizer,
               pad_id: int) -> base.RolloutOutput:
  """Converts vLLM `RequestOutput`s (one per prompt with a count > 0, in order)."""
  live = [i for i, c in enumerate(counts) if c > 0]
  if len(request_outputs) != len(live):
    raise ValueError(f"vLLM returned {len(request_outputs)} outputs for {len(live)} prompts")
  T = sampling.max_new_tokens
  rows = [(i, c) for i, r in zip(live, request_outputs) for c in r.outputs]
  tokens_NxT = np.full((len(rows), T), pad_id, np.int32)
  logprobs_NxT = np.zeros((len(rows), T), np.float32)
  lengths_N = np.zeros(len(rows), np.int32)
  eos_N = np.zeros(len(rows), bool)
  for r, (_, completion) in enumerate(rows):
    ids = list(completion.token_ids)[:T]
    tokens_NxT[r, :len(ids)] = ids
    if completion.logprobs is not None:
      logprobs_NxT[r, :len(ids)] = [lp[t].logprob for t, lp in zip(ids, completion.logprobs)]
    lengths_N[r] = len(ids)
    eos_N[r] = bool(ids) and ids[-1] in eos_ids and completion.finish_reason == "stop"
  return outputs.finalize(tokens_NxT, logprobs_NxT, None, lengths_N, eos_N,
                          np.array([i for i, _ in rows], np.int32), tokenizer,
                          sampling.stop_strings, pad_id)


def _load_weights(worker, weights):
  """Runs inside the vLLM worker: the model maps HF names onto its fused parameters."""
  worker.model_runner.model.load_weights(weights=weights)


@base.ENGINES.register("vllm")
class VllmEngine:
  """Generates with an in-process vLLM `LLM` that receives our weights in memory.

  Args:
    model_cfg: the policy's ModelConfig (its config.json is what vLLM builds).
    tokenizer: HF tokenizer (saved next to the config for vLLM; decodes texts).
    gpu_memory_utilization: vLLM's share of the GPU (see the module docstring).
    dtype: vLLM's compute dtype (default: the model config's).
    max_model_len: longest prompt + response (default: max_position_embeddings).
    seed: vLLM's engine seed (per-request seeds come from the call's key).
    ignore_eos: never stop on EOS (benchmarks).
    **llm_kwargs: passed to `vllm.LLM` (e.g. enforce_eager=True).
  """

  def __init__(self, model_cfg, tokenizer, gpu_memory_utilization: float = 0.3,
               dtype: str | None = None, max_model_len: int | None = None, seed: int = 0,
               ignore_eos: bool = False, **llm_kwargs):
    check_available()
    check_memory_split(gpu_memory_utilization)
    if tokenizer is None:
      raise ValueError("the vllm engine needs the tokenizer")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm  # pylint: disable=g-import-not-at-top
    self.model_cfg, self.tokenizer = model_cfg, tokenizer
    self.eos_ids = base.eos_ids(model_cfg, tokenizer)
    self.pad_id = base.pad_id(model_cfg, tokenizer)
    self.ignore_eos = ignore_eos
    self._dir = tempfile.TemporaryDirectory(prefix="exgrpo_vllm_")
    with open(os.path.join(self._dir.name, "config.json"), "w") as f:
      json.dump(config_lib.to_hf_config(model_cfg, torch_dtype=model_cfg.param_dtype), f)
    tokenizer.save_pretrained(self._dir.name)
    self._vllm = vllm
    self.llm = vllm.LLM(
        model=self._dir.name, load_format="dummy", dtype=dtype or model_cfg.dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len or model_cfg.max_position_embeddings, seed=seed,
        logprobs_mode="processed_logprobs", **llm_kwargs)
    self._loaded = []

  def _is_loaded(self, params) -> bool:
    leaves = jax.tree.leaves(params)
    return len(leaves) == len(self._loaded) and all(
        ref() is leaf for ref, leaf in zip(self._loaded, leaves))

  def update_weights(self, params) -> None:
    """Loads `params` into vLLM's model (in memory) and drops its prefix cache."""
    import torch  # pylint: disable=g-import-not-at-top
    for chunk in weight_chunks(self.model_cfg, params):
      self.llm.collective_rpc(
          _load_weights, args=([(name, torch.from_numpy(a)) for name, a in chunk],))
    self.llm.reset_prefix_cache()
    self._loaded = [weakref.ref(leaf) for leaf in jax.tree.leaves(params)]

  def generate(self, prompt_ids, n, params, key, sampling: base.SamplingConfig):
    """See `base.RolloutEngine`; loads `params` first unless they are already loaded."""
    if sampling.return_entropy:
      raise ValueError("the vllm engine cannot return entropy; use engine 'jax' or "
                       "compute it with the learner")
    counts = base.sample_counts(prompt_ids, n)
    if not self._is_loaded(params):
      self.update_weights(params)
    seeds = np.asarray(jax.random.randint(key, (len(counts),), 0, 2**31 - 1))
    live = [i for i, c in enumerate(counts) if c > 0]
    if not live:
      return outputs.empty(sampling.max_new_tokens, False)
    requests = [{"prompt_token_ids": list(map(int, prompt_ids[i]))} for i in live]
    params_list = [self._vllm.SamplingParams(**sampling_params_kwargs(
        sampling, int(counts[i]), int(seeds[i]), self.eos_ids, self.ignore_eos))
                   for i in live]
    results = self.llm.generate(requests, sampling_params=params_list, use_tqdm=False)
    return to_rollout(results, counts, sampling, self.eos_ids, self.tokenizer, self.pad_id)
