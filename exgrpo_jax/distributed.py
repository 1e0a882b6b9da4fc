"""Multi-host runs: starting `jax.distributed`, and keeping every process's host state equal.

When to initialise (`initialize`, called by `exgrpo_jax.train` before JAX touches a
device): with explicit flags, or `JAX_COORDINATOR_ADDRESS` + `JAX_NUM_PROCESSES` +
`JAX_PROCESS_ID` in the environment; under SLURM with more than one task; on a multi-host
Cloud TPU slice (`TPU_WORKER_HOSTNAMES` lists several hosts, or a Megascale coordinator is
set), where JAX finds everything itself. Single-host machines (8 GPUs, v5p-8, v4-8) run
one process and need none of this.

How the processes stay in step. Every process runs the same trainer on the same inputs:
the same data file, the same seeds, hence the same question stream and replay-buffer
RNG. Every process builds the same global batch, and `sharding.put_batch` copies to
each device only its slice, so a process feeds just its own part of the batch. The
device work is one SPMD program over the global mesh; its host-visible results
(rollout tokens and log-probs, entropies for trajectory selection, metrics) are gathered
to every process (`sharding.to_host`, replicated outputs). Rewards, the one host
computation that could differ (a Math-Verify timeout depends on wall-clock time), are
computed everywhere and then process 0's are broadcast. So the replay buffer, the data
stream, the delayed-start flag and every sampling decision are identical on all
processes, which `RunState.save` checks (a digest compared across processes).

Why replicate the host side instead of splitting it: the buffer and stream live in host
RAM, small next to the model, and their decisions (which questions, which trajectories, what retires) must
be global anyway, because the SPMD program needs one global batch; replicating them
costs some redundant CPU but needs no protocol between hosts beyond JAX's collectives,
makes any process's state the run's state, and lets one process write the host items of
a checkpoint. Process 0 writes metrics (JSONL, TensorBoard) and the checkpoint's JSON
and host items; Orbax writes each process's shards of the sharded params and optimizer
state. A SIGTERM that reaches one process stops all of them after the same step
(`any_process`), so they checkpoint together.
"""

import hashlib
import os
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils


def _multi_host_tpu() -> bool:
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return (len([h for h in hosts.split(",") if h]) > 1
          or "MEGASCALE_COORDINATOR_ADDRESS" in os.environ)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Calls `jax.distributed.initialize` if this is a multi-process run; returns whether."""
  env = os.environ
  coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
  if num_processes is None and env.get("JAX_NUM_PROCESSES"):
    num_processes = int(env["JAX_NUM_PROCESSES"])
  if process_id is None and env.get("JAX_PROCESS_ID"):
    process_id = int(env["JAX_PROCESS_ID"])
  explicit = (coordinator_address, num_processes, process_id)
  if all(x is not None for x in explicit):
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  elif any(x is not None for x in explicit):
    raise ValueError("a multi-process run needs all of coordinator address, number of "
                     "processes and process id (flags or JAX_COORDINATOR_ADDRESS, "
                     f"JAX_NUM_PROCESSES, JAX_PROCESS_ID); got {explicit}")
  elif int(env.get("SLURM_NTASKS", "1")) > 1 or _multi_host_tpu():
    jax.distributed.initialize()
  else:
    return False
  print(f"[exgrpo_jax] process {jax.process_index()}/{jax.process_count()}: "
        f"{jax.local_device_count()} local of {jax.device_count()} devices", file=sys.stderr)
  return True


def is_primary() -> bool:
  return jax.process_index() == 0


def any_process(flag: bool) -> bool:
  """True on every process if `flag` is true on any (e.g. a SIGTERM seen by one host)."""
  if jax.process_count() == 1:
    return flag
  return bool(np.any(multihost_utils.process_allgather(np.array(flag))))


def from_primary(tree):
  """Process 0's value of `tree` (NumPy arrays), on every process."""
  if jax.process_count() == 1:
    return tree
  return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))


def digest(arrays: dict, extra: str = "") -> str:
  """A SHA-256 hex digest of a dict of arrays (keys sorted) and a string."""
  h = hashlib.sha256(extra.encode())
  for key in sorted(arrays):
    a = np.ascontiguousarray(arrays[key])
    h.update(f"{key}|{a.dtype.str}|{a.shape}|".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def check_same_on_all_processes(hex_digest: str, what: str) -> None:
  """Raises on every process if `hex_digest` differs between processes."""
  if jax.process_count() == 1:
    return
  mine = np.frombuffer(bytes.fromhex(hex_digest), np.uint8)
  every = np.asarray(multihost_utils.process_allgather(mine))
  differ = [i for i in range(len(every)) if not np.array_equal(every[i], every[0])]
  if differ:
    raise RuntimeError(f"{what} differs between processes 0 and {differ}: the processes "
                       "have diverged (see exgrpo_jax.distributed)")
