"""Shared pytest fixtures: paths to the real data and model, tiny HF checkpoints, and how
the tests compile (fast on CPU, caches cleared between modules)."""

import json
import os
import subprocess
import sys

import jax
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.join(os.path.dirname(REPO_ROOT), "shared", "data")
# Configs name data files relative to data.dir; here they are the shared files, where
# present (tests that need them skip through `shared_data_dir` otherwise).
if os.path.isdir(SHARED_DATA):
  os.environ.setdefault("EXGRPO_DATA_DIR", SHARED_DATA)
# float32 means float32 in the tests on every backend, as in a float32 training run
# (model.matmul_precision "auto"); JAX's own default is TF32 on NVIDIA GPUs.
jax.config.update("jax_default_matmul_precision", "highest")
# For the child processes that only compile small programs on a mesh (`_fast_compile`).
FAST_COMPILE = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
  """`-n auto`: a worker per core, at most 4. Each worker is a JAX process of a few GB,
  and some tests start children on 8 CPU devices beside it."""
  del config
  return min(4, os.cpu_count() or 1)


@pytest.fixture(autouse=True, scope="session")
def _fast_compile():
  """On CPU the tests' programs are small and each runs a few times: LLVM's optimisation
  of them was most of the suite's time (a third of it in the modules that compile the
  most); every test passes at the same tolerances without it. On a GPU (the accelerator
  check runs this suite there) the programs stay as users run them, and so do the
  processes tests start that run configs/tiny.py or the real model (their programs run
  long); the others pass `FAST_COMPILE` on."""
  jax.config.update("jax_disable_most_optimizations", jax.default_backend() == "cpu")


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_caches():
  """Each test module starts without the compiled programs of the ones before (JAX's
  caches and the JAX engine's, kept for the process). A CPU executable holds 3 memory
  maps while alive; the whole suite in one process kept tens of thousands, and near its
  end XLA crashed compiling (SIGSEGV; SIGABRT at trainer_test in CI, stop 44) at Linux's
  65,530 maps a process (vm.max_map_count)."""
  yield
  from exgrpo_jax.sampling import jax_engine  # pylint: disable=g-import-not-at-top
  jax_engine._COMPILED.clear()  # pylint: disable=protected-access
  jax.clear_caches()


@pytest.fixture(autouse=True)
def _no_persistent_compile_cache(monkeypatch):
  """The CLIs' `main` turns JAX's persistent cache on for the whole process; called
  in-process here, that left every later test reading executables back from disk, and
  jaxlib 0.10's CPU deserialization aborted the suite (CI, stop 44). Tests of the cache
  itself run it in a subprocess (compile_cache_test)."""
  from exgrpo_jax import compile_cache  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(compile_cache, "enable", lambda enabled=True: None)


def subprocess_env(**overrides) -> dict:
  """This environment for a Python subprocess of this checkout: the repository first on
  PYTHONPATH, the rest kept (packages installed with `pip --target`, as
  scripts/accelerator/accelerator_bundle.sh installs them)."""
  path = [REPO_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  return dict(os.environ, PYTHONPATH=os.pathsep.join(path), **overrides)


def run_on_cpu_devices(call: str, devices: int, timeout: float = 600,
                       result: str | None = None):
  """Runs the Python statement `call` (e.g. "from tests import t; t._child('/tmp/x')")
  in a child process of this checkout with `devices` CPU devices (a device count is
  fixed when JAX starts, and the other tests expect one), compiling as `FAST_COMPILE`
  says; fails with the tail of its stderr unless it exits 0. `result`: a JSON file the
  child writes, returned read.

  XLA's CPU client runs the devices' programs on a pool of one thread a core (PJRT_NPROC
  overrides it). A program blocked in a host callback holds its thread: Pallas's TPU
  interpreter waits at a barrier for every device, while a callback of another device
  waits for a transfer that needs a free thread; with fewer threads than devices + 1 (a
  2-core host, 4 devices) that never comes."""
  env = subprocess_env(JAX_PLATFORMS="cpu",
                       XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                       PJRT_NPROC=str(max(os.cpu_count() or 1, 2 * devices)),
                       **FAST_COMPILE)
  proc = subprocess.run([sys.executable, "-c", call], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)
  assert proc.returncode == 0, proc.stderr[-5000:]
  if result:  # the JSON file the child wrote
    with open(result, encoding="utf-8") as f:
      return json.load(f)


@pytest.fixture(scope="session")
def shared_data_dir():
  if not os.path.isdir(SHARED_DATA):
    pytest.skip(f"real data directory {SHARED_DATA} is not present")
  return SHARED_DATA


@pytest.fixture(scope="session")
def smollm2_hf_dir():
  """HF directory of the embedded SmolLM2-135M-Instruct (converted from GGUF once)."""
  from exgrpo_jax import models
  try:
    return models.resolve_hf_dir(models.default_model_path())
  except (FileNotFoundError, ImportError) as e:
    pytest.skip(f"embedded model unavailable: {e}")


@pytest.fixture(scope="session")
def text_model():
  """(cfg, params, tokenizer): a tiny random decoder with the real SmolLM2 tokenizer whose
  scaled-up weights give varied, EOS-ending text."""
  import jax
  from exgrpo_jax import models
  try:
    tokenizer = models.load_tokenizer()
  except (FileNotFoundError, ImportError) as e:
    pytest.skip(f"embedded tokenizer unavailable: {e}")
  cfg = models.ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                           eos_token_id=(tokenizer.eos_token_id,),
                           pad_token_id=tokenizer.pad_token_id)
  params = jax.tree.map(lambda x: x * 30, models.init_params(cfg, jax.random.key(0)))
  return cfg, params, tokenizer
