"""Reading and writing `.safetensors` files tensor by tensor, bfloat16 included.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, byte offsets) and the raw bytes. Reading memory-maps the file, so a 15 GB
checkpoint is never held in host memory at once; bfloat16 maps to `ml_dtypes.bfloat16`,
which the numpy backend of the `safetensors` package cannot represent.
"""

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsFile:
  """A memory-mapped view of one .safetensors file: `names()`, `[name]` -> np.ndarray."""

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      header_len_bytes = f.read(8)
      if len(header_len_bytes) != 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
      (header_len,) = struct.unpack("<Q", header_len_bytes)
      size = os.path.getsize(path)
      if header_len > size - 8:
        raise ValueError(f"{path}: header length {header_len} exceeds the file's {size} "
                         "bytes (truncated, or not a safetensors file)")
      try:
        header = json.loads(f.read(header_len))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    self._header = header
    self._data_start = 8 + header_len
    for name, info in header.items():
      start, end = info["data_offsets"]
      if self._data_start + end > size:
        raise ValueError(f"{path}: tensor {name} ends at byte {self._data_start + end} of a "
                         f"{size}-byte file (truncated)")
      if info["dtype"] in _DTYPES and (end - start != int(np.prod(info["shape"]))
                                       * np.dtype(_DTYPES[info["dtype"]]).itemsize):
        raise ValueError(f"{path}: tensor {name} has {end - start} bytes for shape "
                         f"{info['shape']} {info['dtype']} (corrupt header)")
    self._mmap = np.memmap(path, dtype=np.uint8, mode="r")

  def names(self) -> list[str]:
    return list(self._header)

  def __getitem__(self, name: str) -> np.ndarray:
    info = self._header[name]
    if info["dtype"] not in _DTYPES:
      raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
    start, end = info["data_offsets"]
    raw = self._mmap[self._data_start + start:self._data_start + end]
    return raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict | None = None):
  """Writes `tensors` (name -> array) as one safetensors file."""
  header, offset = {}, 0
  arrays = {}
  for name in sorted(tensors):
    a = np.ascontiguousarray(tensors[name])
    if a.dtype not in _NAMES:
      raise ValueError(f"tensor {name}: dtype {a.dtype} cannot be written to safetensors")
    arrays[name] = a
    header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
  if metadata:
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
  header_bytes = json.dumps(header, separators=(",", ":")).encode()
  header_bytes += b" " * (-len(header_bytes) % 8)  # keeps tensor data 8-byte aligned
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(header_bytes)))
    f.write(header_bytes)
    for name in sorted(arrays):
      f.write(arrays[name].tobytes())
  os.replace(tmp, path)


def open_checkpoint(directory: str) -> dict[str, SafetensorsFile]:
  """Maps every tensor name in an HF directory (single or sharded) to its file."""
  index_path = os.path.join(directory, "model.safetensors.index.json")
  if os.path.exists(index_path):
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
    files = {}
    for filename in sorted(set(weight_map.values())):
      path = os.path.join(directory, filename)
      if not os.path.exists(path):
        raise FileNotFoundError(f"{index_path} names {filename}, which does not exist")
      files[filename] = SafetensorsFile(path)
    return {name: files[filename] for name, filename in weight_map.items()}
  paths = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))
  if not paths:
    raise FileNotFoundError(f"{directory}: no *.safetensors files (and no index.json)")
  result = {}
  for p in paths:
    f = SafetensorsFile(os.path.join(directory, p))
    for name in f.names():
      result[name] = f
  return result
