"""The accelerators `exgrpo_jax.aot` compiles for, named as users name them, and their devices.

A target is a TPU slice or a GPU node. Its devices are compile-only: XLA's TPU compiler
(libtpu, from the `jax[tpu]` wheel) and GPU compiler (the `jax[cuda13]` plugin) build
programs for them on a CPU host without the hardware (`devices`). Nothing runs on them.

  TPU   `jax.experimental.topologies.get_topology_desc(topology_name=..., platform="tpu")`;
        the compiler knows the chip's memory and refuses a program that does not fit.
  GPU   the same call with platform "cuda" and a GpuTargetConfigProto: one captured on
        a real GPU of that model (gpu_specs/, `scripts/accelerator/gpu_target_config.py`), else the
        spec that the installed CUDA plugin itself carries (XLA's target specs, embedded
        in the plugin; `gpu_target_config`), or `--target-config FILE`. XLA:GPU does not
        refuse a program that is too large, so `usable_bytes` is the device memory times
        the share JAX may allocate (XLA_PYTHON_CLIENT_MEM_FRACTION, JAX's default 0.75).

Peak bf16 FLOP/s and HBM bandwidth are the vendors' published figures per device (a
TPU v4/v5p chip is one device: its two cores act as one, "megacore"); they are used
only for roofline estimates.
"""

import dataclasses
import functools
import os

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Target:
  """One machine users run on: `devices` compile-only devices of one kind."""

  platform: str                 # tpu | cuda
  topology: str                 # get_topology_desc's topology name (TPU) or "1x1xN" (GPU)
  devices: int
  device_kind: str              # what the compiler's devices say they are
  hbm_bytes: int                # per device
  peak_flops: float             # bf16 dense, per device
  hbm_bandwidth: float          # bytes/s, per device
  chip_config: str = "default"  # TPU: megacore on v4/v5p
  chips_per_host: tuple = (2, 2, 1)
  wrap: tuple = (False, False, False)
  gpu_spec: str = ""            # GPU: device_description_str of the embedded target spec
  overlap: bool = True          # compute overlaps memory traffic (analysis.bound_s)


def _tpu(topology, devices, kind, hbm_gib, tflops, gbps, **kw) -> Target:
  return Target("tpu", topology, devices, kind, int(hbm_gib * GIB), tflops * 1e12,
                gbps * 1e9, **kw)


def _gpu(devices, kind, hbm_bytes, tflops, gbps) -> Target:
  return Target("cuda", f"1x1x{devices}", devices, kind, hbm_bytes, tflops * 1e12,
                gbps * 1e9, gpu_spec=kind)


# TPU memory: the HBM libtpu 0.0.50 lets a program use ("exceeds available HBM (X G)").
_V4 = dict(kind="TPU v4", hbm_gib=30.75, tflops=275, gbps=1228, chip_config="megacore")
_V5E = dict(kind="TPU v5 lite", hbm_gib=15.75, tflops=197, gbps=819)
_V5P = dict(kind="TPU v5", hbm_gib=95.73, tflops=459, gbps=2765, chip_config="megacore")
_V6E = dict(kind="TPU v6 lite", hbm_gib=31.24, tflops=918, gbps=1640)
_H100 = dict(kind="NVIDIA H100 80GB HBM3", hbm_bytes=84942979072, tflops=989, gbps=3352)
# Captured on the device (gpu_specs/NVIDIA_H200.pbtxt): 1.2 GiB less memory than XLA's spec.
_H200 = dict(kind="NVIDIA H200", hbm_bytes=150109880320, tflops=989, gbps=4800)

TARGETS = {
    "v4-8": _tpu("v4:2x2x1", 4, **_V4),
    "v4-16": _tpu("v4:2x2x2", 8, **_V4),
    "v4-32": _tpu("v4:2x2x4", 16, **_V4),
    "v5e-8": _tpu("v5e:2x4", 8, **_V5E),
    "v5e-16": _tpu("v5e:4x4", 16, **_V5E),
    "v5e-64": _tpu("v5e:8x8", 64, **_V5E),
    "v5p-8": _tpu("v5:2x2x1", 4, **_V5P),
    "v5p-16": _tpu("v5:2x2x2", 8, **_V5P),
    "v5p-64": _tpu("v5:2x4x4", 32, **_V5P),
    "v5p-128": _tpu("v5:4x4x4", 64, wrap=(True, True, True), **_V5P),
    "v6e-8": _tpu("v6e:2x4", 8, **_V6E),
    "v6e-16": _tpu("v6e:4x4", 16, **_V6E),
    "h100x1": _gpu(1, **_H100),
    "h100x8": _gpu(8, **_H100),
    "h200x1": _gpu(1, **_H200),
    "h200x8": _gpu(8, **_H200),
}


def this_cpu(peak_flops: float, bandwidth: float, devices: int = 1) -> Target:
  """This host's CPU as a target, with its measured matmul rate and memory bandwidth
  (`measured_rates`): programs compile for and run on its real devices, so an estimate
  can be set against a measured step (scripts/bench/check_estimate_cpu.py)."""
  import jax  # pylint: disable=g-import-not-at-top
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  # XLA:CPU runs a program's fused ops one after another, each compute- or memory-bound.
  return Target("cpu", "host", devices, jax.devices("cpu")[0].device_kind, memory,
                peak_flops, bandwidth, overlap=False)


def measured_rates(hidden: int, intermediate: int, tokens: int = 1024,
                   repeats: int = 5) -> tuple[float, float]:
  """(float32 matmul FLOP/s on a [tokens, hidden] x [hidden, intermediate] matmul, bytes/s
  of summing a 512 MiB float32 array) on JAX's default device: medians of `repeats`
  timed calls after a warm-up."""
  import time  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  def median_s(f, *args):
    f(*args).block_until_ready()
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      f(*args).block_until_ready()
      times.append(time.perf_counter() - start)
    return float(np.median(times))

  x = jnp.ones((tokens, hidden), jnp.float32)
  w = jnp.ones((hidden, intermediate), jnp.float32)
  flops = 2 * x.size * intermediate / median_s(jax.jit(jnp.matmul), x, w)
  big = jnp.ones((2 ** 27,), jnp.float32)
  return flops, big.nbytes / median_s(jax.jit(jnp.sum), big)


CPU = "cpu"  # this host as a target (`this_cpu`): a plan a CPU run can rehearse with


@functools.cache
def _this_host() -> Target:
  return this_cpu(*measured_rates(1024, 4096))


def get(name: str) -> Target:
  if name == CPU:
    return _this_host()
  if name not in TARGETS:
    raise ValueError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}, {CPU}")
  return TARGETS[name]


def prepare_environment() -> None:
  """Settings the compilers need on a CPU host, before JAX starts a backend: JAX itself
  runs on the CPU; libtpu neither asks a metadata server for a TPU nor takes the lock
  that keeps two processes off one TPU (there is none to share)."""
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "true")
  # Else libtpu's start-up looks for this host's slice and logs an INVALID_ARGUMENT error
  # that reads like a failure; the compile-only topology is given whole in `devices`.
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
  # XLA:GPU spreads autotuning over the devices of a run; there are none to spread to.
  flag = "--xla_gpu_shard_autotuning=false"
  if flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


GPU_SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs")


def gpu_target_config(device_kind: str) -> str:
  """The GpuTargetConfigProto text of `device_kind`: captured on such a GPU (GPU_SPECS,
  named by the device kind), else the one the installed CUDA plugin embeds.

  XLA ships a spec per supported GPU model (xla/backends/gpu/target_config/specs) inside
  the plugin; reading it from there keeps it in step with the compiler that parses it. A
  captured one is the device as it was seen (its memory, cuDNN and CUDA versions).
  """
  captured = os.path.join(GPU_SPECS, device_kind.replace(" ", "_") + ".pbtxt")
  if os.path.exists(captured):
    with open(captured, encoding="utf-8") as f:
      return f.read()
  try:
    import jax_plugins.xla_cuda13 as plugin  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise RuntimeError("no JAX CUDA plugin: install jax[cuda13] in this environment "
                       "(scripts/accelerator/aot_env.sh gpu)") from None
  path = os.path.join(os.path.dirname(plugin.__file__), "xla_cuda_plugin.so")
  with open(path, "rb") as f:
    blob = f.read()
  end_marker = f'device_description_str: "{device_kind}"\n'.encode()
  end = blob.find(end_marker)
  start = blob.rfind(b"gpu_device_info {", 0, end)
  if end < 0 or start < 0:
    raise RuntimeError(f"{path} carries no GPU target spec for {device_kind!r}; pass one "
                       "captured on the GPU with --target-config FILE")
  return blob[start:end + len(end_marker)].decode()


def devices(target: Target, target_config: str | None = None, slices: int = 1) -> list:
  """The target's compile-only devices (`slices` slices of a TPU target)."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  if target.platform == "cpu":
    import jax  # pylint: disable=g-import-not-at-top
    return jax.devices("cpu")[:target.devices]
  if target.platform == "tpu":
    topology = topologies.get_topology_desc(
        topology_name=target.topology, platform="tpu", chip_config_name=target.chip_config,
        chips_per_host_bounds=target.chips_per_host, num_slices=slices, wrap=target.wrap)
  else:
    if slices != 1:
      raise ValueError("--slices applies to TPU targets only")
    topology = topologies.get_topology_desc(
        platform="cuda", topology=target.topology,
        target_config=target_config or gpu_target_config(target.gpu_spec))
  found = list(topology.devices)
  if len(found) != target.devices * slices:
    raise RuntimeError(f"{target.topology}: the compiler made {len(found)} devices, "
                       f"expected {target.devices * slices}")
  return found


# The share of the usable memory a plan leaves free, by platform: what devices measured
# above the compiler's prediction. GPU: on one H200 (docs/accelerator_results.md) the
# learner's temporaries came out 2.3-4.9% above `memory_analysis()`'s (cuDNN's workspace,
# autotuned kernels), with nothing of that in the 5% that XLA_PYTHON_CLIENT_MEM_FRACTION
# 0.95 leaves to the CUDA context. TPU: none; libtpu refuses a program above its limit at
# compile time, and that limit is the device allocator's (a real v6e reports `bytes_limit`
# 31.25 GiB, the compile-time "available HBM"), libtpu's own reserve (0.25-1.25 GiB a
# chip) lying outside it. No TPU has been measured against a plan yet.
MARGIN = {"cuda": 0.05, "tpu": 0.0, "cpu": 0.0}


def margin_bytes(target: Target) -> int:
  """The memory a plan keeps free below `usable_bytes` (MARGIN of it)."""
  return int(usable_bytes(target) * MARGIN[target.platform])


def usable_bytes(target: Target) -> int:
  """Per-device memory a program may use: on TPU the HBM the compiler allows (and
  enforces), on GPU JAX's preallocated share of the device's memory."""
  if target.platform in ("tpu", "cpu"):
    return target.hbm_bytes
  return int(target.hbm_bytes * float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                     0.75)))
