"""Helpers of the fault-injection tests: byte damage, and a small full file system.

Not a test file (pytest collects `*_test.py` only).
"""

import contextlib
import os
import subprocess

import numpy as np
import pytest


def flip_bytes(path: str, n: int = 64) -> None:
  """Inverts `n` bytes at random positions of `path` (the issue's 64 flipped bytes)."""
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    for i in np.random.default_rng(0).choice(len(data), size=min(n, len(data)), replace=False):
      data[i] ^= 0xFF
    f.seek(0)
    f.write(data)


def truncate(path: str) -> None:
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def fill(directory: str) -> None:
  """Writes a filler file until the file system holding `directory` is full."""
  try:
    with open(os.path.join(directory, "filler"), "wb", buffering=0) as f:
      while True:
        f.write(b"\0" * 4096)
  except OSError:
    pass


@contextlib.contextmanager
def small_filesystem(path: str, size: str = "2m"):
  """A tmpfs of `size` mounted at `path` (needs root and mount rights; else skips)."""
  os.makedirs(path, exist_ok=True)
  result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                          capture_output=True, text=True, check=False)
  if result.returncode:
    pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", path], check=False)


@contextlib.contextmanager
def read_only(path: str):
  """`path` made read-only (skips as root, which ignores permissions)."""
  if os.geteuid() == 0:
    pytest.skip("root ignores directory permissions")
  os.chmod(path, 0o555)
  try:
    yield path
  finally:
    os.chmod(path, 0o755)
