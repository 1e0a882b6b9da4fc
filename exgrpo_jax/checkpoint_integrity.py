"""Integrity of checkpoint step directories: a manifest of every file's size and CRC-32,
written after Orbax finishes and verified before a restore, and checks of restored
arrays (shape, finite values). Used by `exgrpo_jax.checkpointing`.
"""

import json
import os
import re
import zlib

import jax
import jax.numpy as jnp

MANIFEST = "exgrpo_manifest.json"


class CheckpointError(Exception):
  """A checkpoint cannot be written, or no intact one can be read."""


def _file_digests(step_dir: str) -> dict[str, list[int]]:
  """{relative path: [size, crc32]} of every file under `step_dir` but the manifest."""
  digests = {}
  for root, _, files in os.walk(step_dir):
    for name in files:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, step_dir)
      if rel.startswith(MANIFEST):
        continue
      crc = 0
      with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
          crc = zlib.crc32(chunk, crc)
      digests[rel] = [os.path.getsize(path), crc]
  return digests


def write_manifest(step_dir: str) -> None:
  digests = _file_digests(step_dir)
  tmp = os.path.join(step_dir, MANIFEST + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(digests, f)
  os.replace(tmp, os.path.join(step_dir, MANIFEST))


def damage(step_dir: str, items) -> str | None:
  """Why `step_dir` is not an intact checkpoint, or None (checked against its manifest;
  a checkpoint written before manifests existed passes if all its items are there)."""
  missing = [item for item in items if not os.path.isdir(os.path.join(step_dir, item))]
  if missing:
    return "empty step directory" if len(missing) == len(items) else \
        f"missing item(s) {', '.join(missing)}"
  manifest = os.path.join(step_dir, MANIFEST)
  if not os.path.exists(manifest):
    return None
  try:
    with open(manifest, encoding="utf-8") as f:
      expected = json.load(f)
  except (OSError, ValueError) as e:
    return f"unreadable manifest ({e})"
  actual = _file_digests(step_dir)
  for rel, (size, crc) in expected.items():
    if rel not in actual:
      return f"file {rel} is missing"
    if actual[rel][0] != size:
      return f"file {rel} has {actual[rel][0]} bytes, expected {size}"
    if actual[rel][1] != crc:
      return f"file {rel} fails its checksum"
  return None


def check_arrays(item: str, restored, abstract) -> None:
  """Every restored array has the expected shape and (floating) finite values."""
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(restored),
                          jax.tree.leaves(abstract)):
    name = f"{item}{jax.tree_util.keystr(path)}"
    if tuple(a.shape) != tuple(b.shape):
      raise CheckpointError(f"{name} has shape {tuple(a.shape)}, expected {tuple(b.shape)}")
    if jnp.issubdtype(a.dtype, jnp.floating) and not bool(jnp.isfinite(a).all()):
      raise CheckpointError(f"{name} holds non-finite values")


def all_finite(tree) -> bool:
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  return bool(jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))) if leaves else True


def root_cause(e: BaseException) -> str:
  """The innermost cause of `e` on one line; an OS error that TensorStore reports inside
  its message (`[os_error_code='28']`) as its plain text, e.g. "No space left on device"."""
  while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
    e = e.__cause__ or e.__context__
  text = str(e).strip()
  code = re.search(r"os_error_code='(\d+)'", text)
  if code:
    return f"{os.strerror(int(code.group(1)))} (errno {code.group(1)})"
  lines = text.splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}"
