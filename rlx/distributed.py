"""The multi-controller helpers: every process of a job runs the same program on its own rows.

    initialize(config.mesh)                      # jax.distributed, when mesh.multihost
    batch = global_array(sharding, local_rows)   # this process's rows -> one global jax.Array
    stop = agree(stop_requested)                 # process 0 decides, every process follows
    metrics = to_host(metrics)                   # device values -> NumPy, on every process
    if lead(): write_metrics(...)                # process 0 alone writes files

The rule of a job: a host-side decision (refill a batch, stop, checkpoint, which
policy version is newest, a reward timeout) is either computed from replicated
device values or decided by process 0 and agreed by all; a decision that differs
between processes hangs every one of them in the next collective. Host data
enters jitted programs only as global arrays built here, each process giving the
rows its devices hold. With one process every helper is a plain local operation.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
        "process_id": "JAX_PROCESS_ID"}


def initialize(*, local_device_ids: list[int] | None = None, timeout_s: int = 300,
               heartbeat_timeout_s: int = 100, shutdown_timeout_s: int = 60) -> None:
  """Joins this process to its job (``jax.distributed.initialize``).

  Coordinator, process count and id come from ``JAX_COORDINATOR_ADDRESS``,
  ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` when set (the local launcher), else
  from the cluster (SLURM, TPU pods). ``local_device_ids`` (or ``RLX_LOCAL_DEVICE_IDS``,
  comma-separated) gives one process all of its node's GPUs: under SLURM, JAX would
  otherwise bind each task to one GPU. CPU processes join over gloo, each on one core of
  its own (see ``_one_core``).
  """
  options = {name: os.environ[env] for name, env in _ENV.items() if env in os.environ}
  if local_device_ids is None and os.environ.get("RLX_LOCAL_DEVICE_IDS"):
    local_device_ids = [int(i) for i in os.environ["RLX_LOCAL_DEVICE_IDS"].split(",")]
  for name in ("num_processes", "process_id"):
    if name in options:
      options[name] = int(options[name])
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only
  jax.distributed.initialize(local_device_ids=local_device_ids, initialization_timeout=timeout_s,
                             heartbeat_timeout_seconds=heartbeat_timeout_s,
                             shutdown_timeout_seconds=shutdown_timeout_s, **options)
  if cpu_only():  # the process's rank on its node: SLURM's, else the launcher's
    _one_core(int(os.environ.get("SLURM_LOCALID", options.get("process_id", 0))))


def cpu_only() -> bool:
  """Whether JAX will run on CPU devices: JAX_PLATFORMS says so, or no accelerator plugin
  (CUDA, ROCm, TPU) is installed."""
  platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  return not any(importlib.util.find_spec(name) for name in ("jax_plugins", "libtpu"))


def _one_core(process_id: int) -> None:
  """Confines this process (before its CPU backend starts) to one core: process i of a node
  gets the i-th core it may use, modulo their count.

  XLA:CPU runs a program's independent operations on a thread pool as large as the cores
  the process may use, and it orders collectives only by when they start. With two or
  more threads, two gloo collectives of one program then overlap, in a different order on
  each process, and gloo aborts ("Received data size doesn't match expected size"): the
  built-in model's FSDP step did at its default size, on every try. With one core the
  pool has one thread, and the collectives run one after another, in program order.
  """
  cores = sorted(os.sched_getaffinity(0))
  os.sched_setaffinity(0, {cores[process_id % len(cores)]})


def lead() -> bool:
  """Whether this is process 0: the one that writes config, metrics and exports."""
  return jax.process_index() == 0


def agree(value: Any) -> Any:
  """Process 0's ``value`` on every process: a bool, int, float, string, or a pytree of
  NumPy-compatible arrays (same structure and shapes on every process)."""
  if jax.process_count() == 1:
    return value
  if isinstance(value, str):
    data = np.frombuffer(value.encode(), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    padded = np.zeros(size, np.uint8)
    padded[:min(size, data.size)] = data[:size]
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(padded))).decode()
  if isinstance(value, (bool, int, float)):
    kind = type(value)
    return kind(np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(value))).item())
  return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(value))


def any_process(flag: bool) -> bool:
  """True on every process when ``flag`` is True on any (e.g. a stop signal one host got)."""
  if jax.process_count() == 1:
    return bool(flag)
  flags = multihost_utils.process_allgather(np.asarray(flag, np.int32))
  return bool(np.asarray(flags).any())


def to_host(tree: Any) -> Any:
  """Every array of ``tree`` as NumPy on every process: a replicated array from a local copy,
  a sharded one gathered whole (``process_allgather``, rows in global order)."""
  def fetch(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(x)
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(fetch, tree)


def global_array(sharding: NamedSharding, local_data: np.ndarray) -> jax.Array:
  """One global array from this process's rows (its share of dimension 0, in process order);
  with one process, ``local_data`` is the whole array."""
  return jax.make_array_from_process_local_data(sharding, np.asarray(local_data))


def global_tree(sharding: NamedSharding, tree: Any) -> Any:
  """``global_array`` of every leaf of ``tree`` (``sharding`` shared by all leaves)."""
  return jax.tree.map(lambda x: global_array(sharding, x), tree)


def check_same(tree: Any, what: str) -> None:
  """Raises on every process when ``tree`` differs between processes (the guard against a
  divergent host decision, on in ``mesh.check_agreement`` debug mode)."""
  if jax.process_count() > 1:
    multihost_utils.assert_equal(tree, f"{what} differs between processes: a host decision "
                                 "diverged; this run would hang at the next collective")


def local_share(rows: list, what: str = "rows") -> tuple[list, int]:
  """This process's contiguous share of ``rows`` (the same list on every process) and the
  index of its first row; the count must split evenly."""
  count, index = jax.process_count(), jax.process_index()
  if len(rows) % count:
    raise ValueError(f"{len(rows)} {what} do not split over {count} processes")
  size = len(rows) // count
  return rows[index * size:(index + 1) * size], index * size


def sum_over_processes(values: np.ndarray) -> np.ndarray:
  """Element-wise sum of a float vector over processes."""
  values = np.asarray(values, np.float64)
  if jax.process_count() == 1:
    return values
  return np.asarray(multihost_utils.process_allgather(values)).sum(0)


def sums_over_processes(named: dict[str, float]) -> dict[str, float]:
  """Each named value summed over processes (every process passes the same names)."""
  names = sorted(named)
  return dict(zip(names, map(float, sum_over_processes([named[name] for name in names]))))


def union_over_processes(names) -> list[str]:
  """The sorted union of every process's ``names`` (strings), the same on every process."""
  names = sorted(set(names))
  if jax.process_count() == 1:
    return names
  data = np.frombuffer("\n".join(names).encode(), np.uint8)
  size = int(max_over_processes([data.size])[0])
  padded = np.zeros(size + 1, np.uint8)
  padded[:data.size] = data
  gathered = np.asarray(multihost_utils.process_allgather(padded))
  found = set()
  for row in gathered:
    text = bytes(row).rstrip(b"\0").decode()
    found.update(name for name in text.split("\n") if name)
  return sorted(found)


def max_over_processes(values: np.ndarray) -> np.ndarray:
  """Element-wise maximum of an int vector over processes."""
  values = np.asarray(values, np.int64)
  if jax.process_count() == 1:
    return values
  return np.asarray(multihost_utils.process_allgather(values)).max(0)


@functools.lru_cache(maxsize=None)
def _replicate(mesh: Mesh):
  """One jitted identity per mesh whose output is replicated (a fresh function each call
  would be traced and compiled again at every weight sync)."""
  return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, PartitionSpec()))


def local_replica(tree: Any) -> Any:
  """A whole copy of every array of ``tree`` on this process's devices, as arrays of a mesh of
  those devices alone: one jitted program gathers them replicated over the global mesh, and
  this process's shards become its local arrays without a copy."""
  gathered = _replicate(jax.tree.leaves(tree)[0].sharding.mesh)(tree)
  local = jax.local_devices()
  local_mesh = Mesh(np.array(local), ("local",))
  local_sharding = NamedSharding(local_mesh, PartitionSpec())

  def assemble(x):
    shards = {shard.device: shard.data for shard in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(x.shape, local_sharding,
                                                    [shards[d] for d in local])
  return jax.tree.map(assemble, gathered)
