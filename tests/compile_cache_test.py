"""The persistent compilation cache: where it goes, that it fills, and the off switch."""

import os
import subprocess
import sys

import jax

from exgrpo_jax import compile_cache
from tests import conftest


# In a fresh process: JAX reads the cache settings once, at its first compile.
_SCRIPT = """
import sys
import jax
from exgrpo_jax import compile_cache
print(compile_cache.enable(sys.argv[1] == "on"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # cache even tiny programs
print(float(jax.jit(lambda x: x * 2 + 1)(1.0)))
"""


def _run(env_overrides: dict, switch: str) -> list[str]:
  env = conftest.subprocess_env(JAX_PLATFORMS="cpu", **env_overrides)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  proc = subprocess.run([sys.executable, "-c", _SCRIPT, switch], env=env, capture_output=True,
                        text=True, check=True, cwd=conftest.REPO_ROOT)
  return proc.stdout.split()


def test_cache_dir_order(monkeypatch, tmp_path):
  monkeypatch.delenv("EXGRPO_JAX_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compile_cache.cache_dir() == str(tmp_path / "exgrpo_jax" / "jax")
  monkeypatch.setenv("EXGRPO_JAX_CACHE_DIR", str(tmp_path / "mine"))
  assert compile_cache.cache_dir() == str(tmp_path / "mine")


def test_enabled_cache_is_written_and_off_switch_writes_nothing(tmp_path):
  on_dir = tmp_path / "on"
  assert _run({"EXGRPO_JAX_CACHE_DIR": str(on_dir)}, "on") == [str(on_dir), "3.0"]
  assert os.listdir(on_dir)
  off_dir = tmp_path / "off"
  assert _run({"EXGRPO_JAX_CACHE_DIR": str(off_dir)}, "off") == ["None", "3.0"]
  assert not off_dir.exists()


def test_cli_switch():
  from exgrpo_jax import generate  # pylint: disable=g-import-not-at-top
  parse = generate._parser().parse_args  # pylint: disable=protected-access
  assert parse(["--prompt", "hi"]).compile_cache
  assert not parse(["--prompt", "hi", "--no-compile-cache"]).compile_cache


def test_an_in_process_cli_call_leaves_the_test_session_without_the_cache(tmp_path):
  from exgrpo_jax import eval as eval_cli  # pylint: disable=g-import-not-at-top
  assert eval_cli.main(["--data", "arithmetic", "--reward", "last_int"]) == 1  # refused after main ran enable()
  assert jax.config.jax_compilation_cache_dir is None
