"""What one compiled program tells: memory, FLOPs, collectives, and a roofline estimate.

Memory comes from XLA (`compiled.memory_analysis()`, per device): the arguments,
outputs, temporaries and the peak of the program, plus what the trainer keeps on the
devices beside it (`resident_bytes`: the learner's state during a rollout, ...), set
against the target's usable memory. XLA's own
`cost_analysis()` (per device) counts every loop body once, whatever its trip count:
the learner's scan over micro-batches and layers, the decode loop. Its figures are
recorded as they are (`xla_flops`, `xla_bytes`), and the estimates use loop-aware counts:

  flops     the matmul FLOPs of the traced program on all the target's devices
            (`flops.matmul_flops`: dot_general, the attention kernels at the blocks they
            compute, each loop body times its trip count, the decode loop's times the
            program's steps), over the devices: an even split is assumed.
  bytes     what each device must read from HBM at least: its arguments and outputs
            once per call (`memory_analysis`), and the decode loop's weights and KV
            cache once per step (the program's `streamed` arguments' shards). A program
            that updates donated state in place (`in_place`: the page pool, the slots)
            neither reads nor writes that state whole per call: its aliased bytes are
            left out, and what it reads of them is in `streamed`.
  roofline  max(flops / peak FLOP/s, bytes / HBM bandwidth) per call (`bound_s`): a
            lower bound on the time that ignores communication, kernel efficiency and
            host work. On a target that does not overlap compute with memory traffic
            (`Target.overlap` false: a host CPU, whose XLA backend runs one fused op
            after another) the two terms add instead.
"""

import dataclasses
import math
import re

import jax
import numpy as np

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute", "collective-broadcast")
_COLLECTIVE_RE = re.compile(r"\b(" + "|".join(_COLLECTIVES) + r")(?:-start)?\(")
_CUSTOM_CALL_RE = re.compile(r'custom_call_target="([^"]+)"')
_COPY_RE = re.compile(r"= ([a-z]+\d*)\[([\d,]*)\][^ ]* copy\(")
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
               "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


@dataclasses.dataclass
class Result:
  """One program's figures (bytes per device; `error` set when it did not compile)."""

  name: str
  purpose: str
  error: str = ""
  compile_s: float = 0.0
  peak_bytes: int = 0
  argument_bytes: int = 0
  output_bytes: int = 0
  temp_bytes: int = 0
  alias_bytes: int = 0
  in_place: bool = False  # its aliased (donated) bytes are updated in place, not copied
  largest_copy_bytes: int = 0  # its largest `copy` instruction's output
  resident_bytes: int = 0  # on the devices beside the program (`Program.resident`)
  usable_bytes: int = 0
  margin_bytes: int = 0  # kept free below usable_bytes (`targets.MARGIN`)
  xla_flops: float = 0.0
  xla_bytes: float = 0.0
  flops_per_device: float = 0.0
  hbm_bytes_per_call: float = 0.0
  collectives: dict = dataclasses.field(default_factory=dict)
  custom_calls: dict = dataclasses.field(default_factory=dict)  # kernels, by target
  roofline_s: float = 0.0
  calls_per_step: float = 0.0

  @property
  def device_peak_bytes(self) -> int:
    """The program's peak plus what stays on the devices beside it."""
    return self.peak_bytes + self.resident_bytes

  @property
  def fits(self) -> bool:
    """Within the usable memory less the margin: what a plan may choose."""
    return not self.error and self.device_peak_bytes <= self.usable_bytes - self.margin_bytes

  @property
  def fits_without_margin(self) -> bool:
    """Within the usable memory but not its margin: never chosen."""
    return (not self.error and not self.fits
            and self.device_peak_bytes <= self.usable_bytes)


def shard_bytes(tree) -> int:
  """Bytes one device holds of `tree`'s arrays (ShapeDtypeStructs with shardings)."""
  total = 0
  for x in jax.tree.leaves(tree):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      continue
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total


def collectives(hlo_text: str) -> dict:
  """How many of each collective the compiled program's text holds (loop bodies once)."""
  return _count(_COLLECTIVE_RE.findall(hlo_text))


def custom_calls(hlo_text: str) -> dict:
  """How many custom calls of each target (a Mosaic kernel: `tpu_custom_call`) the
  compiled program's text holds (loop bodies once)."""
  return _count(_CUSTOM_CALL_RE.findall(hlo_text))


def largest_copy_bytes(hlo_text: str) -> int:
  """The largest output of the compiled program's `copy` instructions: one as large as a
  layer of the page pool would say that a program meant to update the pool in place
  copies it instead."""
  return max((_ITEM_BYTES.get(dtype, 4) * math.prod(int(n) for n in dims.split(",") if n)
              for dtype, dims in _COPY_RE.findall(hlo_text)), default=0)


def _count(found) -> dict:
  counts = {}
  for kind in found:
    counts[kind] = counts.get(kind, 0) + 1
  return counts


def xla_cost(compiled) -> dict:
  """XLA's cost analysis (per device, loop bodies once); XLA:GPU's compile-only
  executable offers none, so its HLO module is costed by the host's analysis."""
  cost = compiled.cost_analysis()
  if cost is None:  # pragma: no cover - depends on the backend
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
    module = compiled.runtime_executable().hlo_modules()[0]
    cost = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return cost or {}


def peak_bytes(memory) -> int:
  """The compiler's peak, or (older JAX) arguments + outputs + temporaries - aliases."""
  peak = getattr(memory, "peak_memory_in_bytes", 0)
  return int(peak or (memory.argument_size_in_bytes + memory.output_size_in_bytes
                      + memory.temp_size_in_bytes - memory.alias_size_in_bytes))


def call_bytes(program: dict) -> float:
  """A program's HBM bytes once per call (its `Result` as a dict, or a report's entry):
  its arguments and outputs, less twice the bytes it updates in place (see the module
  docstring; reports from before `in_place` count them)."""
  in_place = 2 * program["alias_bytes"] if program.get("in_place") else 0
  return program["argument_bytes"] + program["output_bytes"] - in_place


def bound_s(flops, hbm_bytes, target: dict):
  """The roofline seconds of `flops` and `hbm_bytes` (numbers or arrays) on `target` (a
  report's target: peak_flops, hbm_bandwidth, overlap): the larger of the compute and
  memory times, or their sum where the target does not overlap them."""
  compute, memory = flops / target["peak_flops"], hbm_bytes / target["hbm_bandwidth"]
  return np.maximum(compute, memory) if target.get("overlap", True) else compute + memory


def roofline(result: Result, streamed_bytes: int, steps: int, target: dict) -> None:
  """Fills `result`'s HBM bytes per call and roofline time (see the module docstring)."""
  result.hbm_bytes_per_call = call_bytes(dataclasses.asdict(result)) + steps * streamed_bytes
  result.roofline_s = float(bound_s(result.flops_per_device, result.hbm_bytes_per_call,
                                    target))
