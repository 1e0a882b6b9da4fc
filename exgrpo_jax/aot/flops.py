"""The matmul FLOPs of a traced program, loops at their trip counts (`matmul_flops`).

The count is the work of all the devices that run the program, over its global shapes:

  dot_general       2 x its output's size x its contracted size;
  cuDNN attention   its [T x S] matmuls per head (2 forward, 5 backward: recomputed
                    scores, dV, dP, dQ, dK), over the causal triangle where its mask type
                    is causal (cuDNN then skips the blocks above the diagonal), else over
                    all of T x S (a mask given as an array is applied, not skipped);
  Pallas kernels    the body at every grid step; splash attention's only at the steps its
                    block mask runs (a causal mask skips the blocks above the diagonal);
                    the ragged paged-attention kernel (TPU decode): at each row, the whole
                    block of queries over the key blocks the row's live pages fill
                    (`kv_share` of its page table: `programs.Program.cache_share`);
  scan              its body times its length, or iteration by iteration where the body
                    holds a loop and the scan runs over constants (`blockwise` attention's
                    query blocks);
  while             its trip count where the trace fixes it (a `fori_loop` to a bound
                    computed from constants: `blockwise` attention's causal loops);
                    otherwise (the decode loop) `loop_steps` times, and once inside such a
                    loop or a kernel;
  cond              its costliest branch, or the one a constant index takes;
  shard_map         its body (per-shard shapes) times the devices it runs on: the product
                    of the mesh axes it makes manual.

So the count over a program's devices is each device's work where they split it evenly
(`check.compile_program`'s `flops_per_device`). Constants are followed through the program
(the arrays XLA would fold: small ones, from literals and the program's constants).
"""

import math

import jax
import numpy as np

_SMALL = 1 << 16  # the most elements a folded constant has
_SIMULATED_TRIPS = 1 << 12  # a loop that runs longer is not simulated
_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call",
          "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin")


def _parts(jaxpr) -> tuple:
  """(the jaxpr, the values of its leading constants): a closed jaxpr's (JAX 0.12's
  Jaxpr carries its own), an open one's none."""
  return getattr(jaxpr, "jaxpr", jaxpr), tuple(getattr(jaxpr, "consts", ()))


def _jaxprs(value):
  """The (jaxpr, consts) inside an equation parameter (a jaxpr, a closed one, a tuple)."""
  if isinstance(value, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
    return [_parts(value)]
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in _jaxprs(v)]
  return []


def causal_pairs(T: int, S: int) -> int:
  """Query-key pairs of causal attention of T queries over S keys, the queries the last
  T key slots (a cache of S - T slots before them)."""
  return sum(min(S, t + 1 + S - T) for t in range(T))


def _attention(eqn, passes: int) -> float:
  q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape  # [B, T, H, Dh], [B, S, K, Dh]
  pairs = (causal_pairs(q[1], k[1]) if "CAUSAL" in str(eqn.params.get("mask_type", ""))
           else q[1] * k[1])
  return 2.0 * passes * q[0] * q[2] * q[3] * pairs


class _Counter:
  """One walk over a program: FLOPs, and the values of its small constants on the way."""

  def __init__(self, loop_steps: int, kv_share: float):
    self.loop_steps, self.kv_share = loop_steps, kv_share
    self.nested = False  # inside a loop of unknown trip count or a kernel
    self.loops = {}  # `_has_loop`'s answers, by jaxpr id

  def run(self, jaxpr, inputs, count: bool = True):
    """(FLOPs, the outputs' values where known) of `jaxpr` given its inputs' (None:
    unknown)."""
    env = dict(zip(jaxpr.invars, inputs))
    read = lambda v: np.asarray(v.val) if isinstance(v, jax.extend.core.Literal) else env.get(v)
    total = 0.0
    for eqn in jaxpr.eqns:
      flops, outs = self._eqn(eqn, [read(v) for v in eqn.invars], count)
      total += flops
      env.update((v, x) for v, x in zip(eqn.outvars, outs) if x is not None)
    return total, [read(v) for v in jaxpr.outvars]

  def _eqn(self, eqn, ins, count):
    name, params = eqn.primitive.name, eqn.params
    unknown = [None] * len(eqn.outvars)
    if name == "dot_general":
      (contract, _), _ = params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      return (2.0 * math.prod(eqn.outvars[0].aval.shape)
              * math.prod(lhs[i] for i in contract), unknown)
    if name.startswith("dot_product_attention_fwd"):
      return _attention(eqn, 2), unknown
    if name.startswith("dot_product_attention_bwd"):
      return _attention(eqn, 5), unknown
    if name == "shard_map":
      return self._shard_map(eqn, ins, count)
    loops = {"scan": self._scan, "while": self._while, "cond": self._cond,
             "pallas_call": self._pallas}
    if name in loops:  # their outputs are not followed
      return (loops[name](eqn, ins) if count else 0.0), unknown
    subs = [j for v in params.values() for j in _jaxprs(v)]
    if name in _CALLS and len(subs) == 1 and len(subs[0][0].invars) == len(ins):
      return self.call(*subs[0], ins, count)
    flops = sum(self.call(j, c, [None] * len(j.invars), count)[0] for j, c in subs)
    return flops, unknown if subs else _fold(eqn, ins)

  def call(self, jaxpr, consts, ins, count=True):
    """`run` of a sub-jaxpr, its constants (`consts`, else unknown) before its inputs."""
    known = [np.asarray(c) if _foldable(c) else None for c in consts]
    known += [None] * (len(jaxpr.constvars) - len(known))
    return self.run(_Opened(jaxpr), known + list(ins), count)

  def _has_loop(self, jaxpr) -> bool:
    """Whether `jaxpr` holds a while loop or a Pallas kernel at any depth."""
    if id(jaxpr) not in self.loops:
      self.loops[id(jaxpr)] = any(
          e.primitive.name in ("while", "pallas_call")
          or any(self._has_loop(j) for v in e.params.values() for j, _ in _jaxprs(v))
          for e in jaxpr.eqns)
    return self.loops[id(jaxpr)]

  def _scan(self, eqn, ins):
    p = eqn.params
    body, consts = _parts(p["jaxpr"])
    head, carry, xs = _scan_parts(p, ins)
    n_carry, length = len(carry), p["length"]
    if not (any(x is not None for x in xs) and self._has_loop(body)):
      return length * self.call(body, consts, head + [None] * (n_carry + len(xs)))[0]
    total = 0.0
    for i in range(length):
      at = length - 1 - i if p["reverse"] else i
      flops, outs = self.call(body, consts, head + carry + [
          None if x is None else x[at] for x in xs])
      total, carry = total + flops, outs[:n_carry]
    return total

  def _while(self, eqn, ins):
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond, body = _parts(p["cond_jaxpr"]), _parts(p["body_jaxpr"])
    cond_in, body_in, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
    trips = None
    for n in range(_SIMULATED_TRIPS):  # the loop run on its known values, while they last
      go = self.call(*cond, cond_in + carry, False)[1][0]
      if go is None:
        break
      if not go:
        trips = n
        break
      carry = self.call(*body, body_in + carry, False)[1]
    nested = self.nested
    if trips is None:
      trips, self.nested = (1 if nested else self.loop_steps), True
    flops = self.call(*body, body_in + [None] * len(carry))[0]
    self.nested = nested
    return trips * flops

  def _cond(self, eqn, ins):
    branches = eqn.params["branches"]
    index, operands = ins[0], ins[1:]
    if index is not None:
      branches = [branches[int(np.clip(index, 0, len(branches) - 1))]]
    return max(self.call(*_parts(b), operands)[0] for b in branches)

  def _shard_map(self, eqn, ins, count):
    """Its body's FLOPs times its devices; a constant whose shards are alike goes in
    as that shard, and one that comes out alike from every device goes out tiled (as
    the forward's constants reach the backward: `shard_map`'s residuals)."""
    p = eqn.params
    mesh = p["mesh"]
    axes = next((p[k] for k in ("newly_manual_axes", "manual_axes") if k in p),
                mesh.axis_names)
    sizes = {a: dict(mesh.shape)[a] for a in axes}
    flops, outs = self.call(*_parts(p["jaxpr"]), [
        _shard(x, spec, sizes) for x, spec in zip(ins, p["in_specs"])], count)
    return math.prod(sizes.values()) * flops, [
        _tile(x, spec, sizes) for x, spec in zip(outs, p["out_specs"])]

  def _pallas(self, eqn, ins):
    p = eqn.params
    grid = p["grid_mapping"].grid
    name = str(p.get("name") or getattr(p.get("name_and_src_info"), "name", ""))
    nested, self.nested = self.nested, True
    body = self.call(*_parts(p["jaxpr"]), [None] * len(p["jaxpr"].invars))[0]
    self.nested = nested
    steps = math.prod(grid)
    if name.startswith("splash") and p["grid_mapping"].num_index_operands >= 2:
      block_mask = ins[1]  # (data_next, block_mask, ...): splash's scalar prefetch
      if block_mask is not None:
        steps *= float(np.mean(block_mask != 0))
    elif name == "ragged_paged_attention_kernel":
      steps *= self._paged_visits(eqn, grid)
    return steps * body

  def _paged_visits(self, eqn, grid) -> float:
    """Per grid step of the ragged paged-attention kernel, its (row, key block) visits:
    each row of its query block (one query a row: decode) over the key blocks its live
    pages fill."""
    page_table, q = eqn.invars[1].aval.shape, eqn.invars[5].aval.shape
    buffers = next(v.aval.shape for v in eqn.params["jaxpr"].invars
                   if len(v.aval.shape) == 5 and v.aval.shape[0] == 2)  # kv double buffer
    rows_per_block = -(-q[0] // grid[1])
    return rows_per_block * math.ceil(self.kv_share * page_table[-1] / buffers[1])


def _reps(spec, ndim: int, sizes: dict) -> list[int]:
  """Per dimension, the shards a `shard_map` spec splits it into."""
  entries = list(spec) + [None] * (ndim - len(tuple(spec)))
  return [math.prod(sizes.get(a, 1) for a in (e if isinstance(e, tuple) else (e,)) if a)
          for e in entries]


def _shard(x, spec, sizes):
  """A device's shard of the known value `x`, where every device's is the same."""
  if x is None:
    return None
  reps = _reps(spec, x.ndim, sizes)
  shards = [x]
  for axis, n in enumerate(reps):
    shards = [piece for s in shards for piece in np.split(s, n, axis=axis)]
  return shards[0] if all(np.array_equal(s, shards[0]) for s in shards) else None


def _tile(x, spec, sizes):
  """The global value of outputs `x`, alike on every device, by the spec's tiling."""
  if x is None:
    return None
  tiled = np.tile(x, _reps(spec, x.ndim, sizes))
  return tiled if tiled.size <= _SMALL else None


def _scan_parts(params, ins) -> tuple[list, list, list]:
  """A scan's (constants, initial carry, scanned arrays) among its inputs `ins`."""
  if "ft_in" in params:  # JAX 0.12: a flat tree of the three
    return tuple(list(part) for part in params["ft_in"].update(ins).unpack())
  n, c = params["num_consts"], params["num_carry"]
  return ins[:n], ins[n:n + c], ins[n + c:]


class _Opened:
  """A jaxpr whose constants are inputs before its own (what `_Counter.run` reads)."""

  def __init__(self, jaxpr):
    self.invars = list(jaxpr.constvars) + list(jaxpr.invars)
    self.eqns, self.outvars = jaxpr.eqns, jaxpr.outvars


def _foldable(x) -> bool:
  return hasattr(x, "shape") and math.prod(np.shape(x)) <= _SMALL


def _fold(eqn, ins):
  """The equation's outputs where its inputs are known and its outputs small (and it has
  no effects: a host callback is not called)."""
  if eqn.effects or any(x is None for x in ins) or sum(
      math.prod(v.aval.shape) for v in eqn.outvars) > _SMALL:
    return [None] * len(eqn.outvars)
  try:
    outs = eqn.primitive.bind(*ins, **eqn.params)
  except Exception:  # pylint: disable=broad-except
    return [None] * len(eqn.outvars)
  outs = outs if eqn.primitive.multiple_results else [outs]
  return [np.asarray(x) for x in outs]


def matmul_flops(jaxpr, loop_steps: int = 1, kv_share: float = 1.0) -> float:
  """Matmul FLOPs of `jaxpr` (a closed jaxpr, whose constants are followed, or an open
  one) on all its devices: see the module docstring. `loop_steps`: the trip count of its
  decode loop; `kv_share`: the share of a row's pages its decode attention reads."""
  jaxpr, consts = _parts(jaxpr)
  return _Counter(loop_steps, kv_share).call(jaxpr, consts, [None] * len(jaxpr.invars))[0]


def program_flops(program, traced) -> float:
  """`matmul_flops` of `programs.Program` `program` as `traced` (its `jit(...).trace`)."""
  return matmul_flops(traced.jaxpr, program.steps, program.cache_share)
