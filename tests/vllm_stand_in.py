"""A stand-in for the `vllm` package: only the API the vLLM engine calls, recording calls.

Used only for what vLLM's CPU build cannot show (tests/vllm_real_test.py runs the real
one): sleep and wake around the learner (CUDA only), the options the engine passes, and
two JAX processes splitting the rows through the external launcher. Install it with
`sys.modules["vllm"] = vllm_stand_in`. It keeps vLLM's documented state rules, so a wrong
order fails loudly: `generate` needs the weights and KV cache awake, a weight reload needs
the weights awake, `sleep(level=2)` discards the weights. Every call is appended to
`LLM.calls` as (name, detail); loaded tensors are kept as `LLM.loaded[name] = (shape,
torch dtype, float32 numpy values)`; `LLM.generated_with` is what was loaded when
`generate` last ran.

Generation is a fixed function of the prompt, the sample's index and the request seed
(no model), so outputs do not depend on which process generated them.
"""

import json
import os
import types


INSTANCES = []  # every LLM built, in order


class SamplingParams:

  def __init__(self, **kwargs):
    self.kwargs = kwargs
    self.__dict__.update(kwargs)


class _Worker:
  """The in-process worker: vLLM's in-place reload of (HF name, torch tensor) pairs."""

  def __init__(self, llm):
    self.llm = llm
    head = types.SimpleNamespace()
    head.quant_method = types.SimpleNamespace(
        process_weights_after_loading=lambda layer: llm.calls.append(("refresh_head", None)))
    model = types.SimpleNamespace(lm_head=head)
    self.model_runner = types.SimpleNamespace(model=model, get_model=lambda: model,
                                              reload_weights=self.reload_weights)

  def reload_weights(self, weights_iterator=None, weights_path=None,
                     is_checkpoint_format=True):
    del weights_path
    assert is_checkpoint_format
    if "weights" in self.llm.asleep:
      raise RuntimeError("reload_weights while the weights are asleep")
    names = []
    for name, tensor in weights_iterator:
      self.llm.loaded[name] = (tuple(tensor.shape), tensor.dtype,
                               tensor.float().numpy().copy())
      names.append(name)
    self.llm.calls.append(("reload_weights", names))


def _token(prompt, sample: int, seed: int, step: int, vocab: int) -> int:
  return (31 * sum(prompt) + 7 * sample + 3 * step + seed) % vocab


class LLM:
  """Records its arguments and calls; see the module docstring."""

  def __init__(self, model, **kwargs):
    self.kwargs = dict(model=model, **kwargs)
    self.env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                               "MASTER_ADDR", "MASTER_PORT")}
    with open(os.path.join(model, "config.json")) as f:
      self.vocab = json.load(f)["vocab_size"]
    self.calls = [("LLM", self.kwargs)]
    self.asleep, self.loaded = set(), {}
    self.worker = _Worker(self)
    self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(
        shutdown=lambda: self.calls.append(("shutdown", None))))
    INSTANCES.append(self)

  def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
    del timeout
    return [method(self.worker, *args, **(kwargs or {}))]

  def sleep(self, level: int = 1):
    self.calls.append(("sleep", level))
    self.asleep = {"weights", "kv_cache"}
    if level == 2:
      self.loaded = {}

  def wake_up(self, tags=None):
    self.calls.append(("wake_up", tags))
    self.asleep -= set(tags or ("weights", "kv_cache"))

  def reset_prefix_cache(self):
    self.calls.append(("reset_prefix_cache", None))

  def generate(self, prompts, sampling_params=None, use_tqdm=True):
    del use_tqdm
    if self.asleep:
      raise RuntimeError(f"generate while {sorted(self.asleep)} asleep")
    if not self.loaded:
      raise RuntimeError("generate before any weights were loaded")
    self.calls.append(("generate", [list(p["prompt_token_ids"]) for p in prompts]))
    self.generated_with = dict(self.loaded)
    results = []
    for prompt, sp in zip(prompts, sampling_params):
      ids = prompt["prompt_token_ids"]
      completions = []
      for s in range(sp.n):
        tokens, finish = [], "length"
        for j in range(sp.max_tokens):
          tokens.append(_token(ids, s, sp.seed, j, self.vocab))
          if tokens[-1] in sp.stop_token_ids:
            finish = "stop"
            break
        logprobs = [{t: types.SimpleNamespace(logprob=-0.1 * (1 + t % 7))} for t in tokens]
        completions.append(types.SimpleNamespace(token_ids=tokens, finish_reason=finish,
                                                 logprobs=logprobs))
      results.append(types.SimpleNamespace(outputs=completions))
    return results


def tiny_tokenizer(vocab_size: int):
  """A real (word-level) HF tokenizer over tokens t0..t{V-1}; t2 is EOS, t0 padding."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  vocab = {f"t{i}": i for i in range(vocab_size)}
  model = tokenizers.models.WordLevel(vocab, unk_token="t1")
  backend = tokenizers.Tokenizer(model)
  backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  backend.decoder = tokenizers.decoders.WordPiece(prefix="##", cleanup=False)
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, eos_token="t2", pad_token="t0", unk_token="t1")
