"""One of two JAX processes driving the vLLM engine: the stand-in `vllm` module, or "real".

Run by tests/sampling_vllm_test.py (stand-in) and tests/vllm_real_test.py ("real": vLLM's
CPU build, a tiny model it runs) with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID set; prints one JSON line: what this process's vLLM was given (stand-in)
and what `generate` returned (all rows, gathered from both processes).
"""

import dataclasses
import json
import socket
import subprocess
import sys

from exgrpo_jax import distributed


def real_config(tiny):
  """The stand-in's tiny model as vLLM's CPU build runs it: a Qwen2 (biases on q, k, v
  only; a Llama with attention_bias has one on o_proj too) with vLLM CPU's smallest
  head_dim, which Qwen2 derives as hidden_size / num_heads."""
  return dataclasses.replace(tiny, model_type="qwen2", hidden_size=tiny.num_heads * 32,
                             head_dim=32, dtype="float32")


def run(*args: str) -> list[dict]:
  """Runs this module in two JAX processes; their JSON lines."""
  from tests import conftest  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = [subprocess.Popen(
      [sys.executable, "-m", "tests.vllm_two_process_main", *args], cwd=conftest.REPO_ROOT,
      text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      env=conftest.subprocess_env(
          JAX_PLATFORMS="cpu", XLA_FLAGS="", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
          JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid))) for pid in range(2)]
  results = []
  for proc in procs:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    results.append(json.loads(out.strip().splitlines()[-1]))
  return results


def main() -> None:
  real = sys.argv[1:] == ["real"]
  distributed.initialize()
  import jax  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import sampling  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.sampling import vllm_engine  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.sampling import vllm_setup  # pylint: disable=g-import-not-at-top
  from tests import sampling_vllm_test as t  # pylint: disable=g-import-not-at-top
  from tests import vllm_stand_in  # pylint: disable=g-import-not-at-top
  cfg = real_config(t.TINY) if real else t.TINY
  config = sampling.SamplingConfig(greedy=real, max_new_tokens=5)
  if not real:
    sys.modules["vllm"] = vllm_stand_in
    vllm_engine.check_available = lambda: "cuda"
    vllm_engine._device_bytes = lambda rank: 80 * vllm_setup.GIB  # pylint: disable=protected-access
  params = t.tiny_params(cfg)  # sharded over both processes' devices
  engine = vllm_engine.VllmEngine(cfg, vllm_stand_in.tiny_tokenizer(cfg.vocab_size),
                                  vllm_setup.VllmOptions(max_model_len=48, sleep_level=0,
                                                         enforce_eager=True))
  out = engine.generate(t.PROMPTS, t.COUNTS, params, jax.random.key(7), config)
  result = dict(tokens=out.tokens_NxT.tolist(), prompt_index=out.prompt_index_N.tolist(),
                logprobs=out.logprobs_NxT.tolist(), texts=out.texts)
  if not real:
    llm = vllm_stand_in.INSTANCES[0]
    result.update(
        env=llm.env, backend=llm.kwargs.get("distributed_executor_backend"),
        seed=llm.kwargs["seed"], generated=[d for k, d in llm.calls if k == "generate"][0],
        loaded=[n for k, names in llm.calls if k == "reload_weights" for n in names],
        loaded_sums={n: float(v[2].astype("float64").sum())
                     for n, v in llm.generated_with.items()})
  engine.close()
  print(json.dumps(result))


if __name__ == "__main__":
  main()
