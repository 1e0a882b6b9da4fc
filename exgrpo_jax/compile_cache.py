"""JAX's persistent compilation cache, on by default for train, eval and generate.

  compile_cache.enable()          # before the first jit compiles; returns the directory

Compiled programs are written to `cache_dir()` and reused by later runs with the same
shapes, so a second `generate`/`eval` call or a resumed run skips most of its compile
time. The directory is `$EXGRPO_JAX_CACHE_DIR`, else `$XDG_CACHE_HOME/exgrpo_jax/jax`,
else `~/.cache/exgrpo_jax/jax`; a directory set through JAX's own
`JAX_COMPILATION_CACHE_DIR` wins. Turn it off with `--config.train.compile_cache=False`
(train) or `--no-compile-cache` (eval, generate).
"""

import os
import sys

import jax

# Cache programs that took at least this long to compile. JAX's default (1 s) skips the
# sampler's and learner's many small programs on GPU; on CPU they are most of start-up.
MIN_COMPILE_S = 0.2


def cache_dir() -> str:
  """Where compiled programs go (see the module docstring for the order)."""
  if os.environ.get("EXGRPO_JAX_CACHE_DIR"):
    return os.environ["EXGRPO_JAX_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "exgrpo_jax", "jax")


def enable(enabled: bool = True) -> str | None:
  """Turns the persistent cache on (or leaves JAX's settings alone); returns its path."""
  if not enabled:
    return None
  directory = jax.config.jax_compilation_cache_dir or cache_dir()
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:  # a read-only home: run without the cache rather than fail
    print(f"[exgrpo_jax] compilation cache off: cannot create {directory}: {e}",
          file=sys.stderr)
    return None
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
  return directory
