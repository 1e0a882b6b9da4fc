"""One of two JAX processes driving the vLLM engine through the stand-in `vllm` module.

Run by tests/sampling_vllm_test.py with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID set; prints one JSON line: what this process's vLLM was given and what
`generate` returned (all rows, gathered from both processes).
"""

import json
import sys

from exgrpo_jax import distributed


def main() -> None:
  distributed.initialize()
  import jax  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import sampling  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.sampling import vllm_engine  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.sampling import vllm_setup  # pylint: disable=g-import-not-at-top
  from tests import sampling_vllm_test as t  # pylint: disable=g-import-not-at-top
  from tests import vllm_stand_in  # pylint: disable=g-import-not-at-top
  sys.modules["vllm"] = vllm_stand_in
  vllm_engine.check_available = lambda: "cuda"
  vllm_engine._device_bytes = lambda rank: 80 * vllm_setup.GIB  # pylint: disable=protected-access
  params = t.tiny_params()  # sharded over both processes' devices
  engine = t.make(t.TINY)
  out = engine.generate(t.PROMPTS, t.COUNTS, params, jax.random.key(7),
                        sampling.SamplingConfig(max_new_tokens=5))
  llm = vllm_stand_in.INSTANCES[0]
  print(json.dumps(dict(
      env=llm.env, backend=llm.kwargs.get("distributed_executor_backend"),
      seed=llm.kwargs["seed"], generated=[d for k, d in llm.calls if k == "generate"][0],
      loaded=[n for k, names in llm.calls if k == "reload_weights" for n in names],
      loaded_sums={n: float(v[2].astype("float64").sum()) for n, v in llm.generated_with.items()},
      tokens=out.tokens_NxT.tolist(), prompt_index=out.prompt_index_N.tolist(),
      logprobs=out.logprobs_NxT.tolist(), texts=out.texts)))


if __name__ == "__main__":
  main()
