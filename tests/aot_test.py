"""Ahead-of-time compilation for TPU and GPU targets with the real compilers, on CPU.

Each case runs `tests/aot_child.py` in the target's AOT environment (libtpu from
jax[tpu], the CUDA plugin from jax[cuda13]; `scripts/aot_env.sh` makes them under .aot/,
or name their pythons in EXGRPO_AOT_TPU_PYTHON / EXGRPO_AOT_GPU_PYTHON) and skips,
naming it, where that environment is missing. The learner step with a fused attention
kernel must compile on a multi-device mesh; without `shard_map` around the kernel (the
code before the fix) the same compile must fail the way the compilers refused it.
"""

import json
import os
import subprocess

import pytest

from tests import conftest

ENVIRONMENTS = {"tpu": "EXGRPO_AOT_TPU_PYTHON", "gpu": "EXGRPO_AOT_GPU_PYTHON"}
# case -> (environment, target, attention, mesh, how the unsharded kernel failed)
CASES = {
    "splash_v5p_2x2": ("tpu", "v5p-8", "splash", "2x2",
                       "Mosaic kernels cannot be automatically partitioned"),
    "cudnn_h100_2x4": ("gpu", "h100x8", "cudnn", "2x4",
                       "Query, key and value should have same sharding"),
}


def aot_python(environment: str) -> str:
  """The AOT environment's python, or a skip naming how to make it."""
  path = os.environ.get(ENVIRONMENTS[environment]) or os.path.join(
      conftest.REPO_ROOT, ".aot", environment, "bin", "python")
  if not os.path.exists(path):
    pytest.skip(f"no {environment.upper()} AOT environment ({path}): "
                f"bash scripts/aot_env.sh {environment}")
  return path


def compile_case(case: str, *extra: str) -> subprocess.CompletedProcess:
  environment, target, attention_name, mesh, _ = CASES[case]
  return subprocess.run(
      [aot_python(environment), "-m", "tests.aot_child", target, attention_name, mesh,
       *extra], cwd=conftest.REPO_ROOT, env=conftest.subprocess_env(), capture_output=True,
      text=True, timeout=900, check=False)


@pytest.mark.parametrize("case", CASES)
def test_learner_step_with_fused_attention_compiles_on_a_mesh(case):
  proc = compile_case(case)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  environment, _, attention_name, _, _ = CASES[case]
  assert result["platform"] == environment  # the target's devices, not the host's CPU
  assert result["auto"] == attention_name  # `auto` resolves against the target
  for name, program in result["programs"].items():
    assert program["error"] == "", (name, program["error"])
    assert program["peak_bytes"] > 0
    assert program["collectives"], name  # really partitioned over the mesh


@pytest.mark.parametrize("case", CASES)
def test_without_shard_map_the_compiler_refuses_the_kernel(case):
  proc = compile_case(case, "--unsharded-kernels")
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert CASES[case][4] in result["programs"]["learner_step"]["error"]
