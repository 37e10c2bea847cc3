"""How the code sandbox bounds a run's memory: a cgroup v2 memory cgroup per run where this
process may create one, or few enough processes that their address spaces together fit."""

from __future__ import annotations

import errno
import os
import pathlib
import secrets
import time


_PROCESSES = 32  # processes (threads included) of one run, when a cgroup bounds its memory
_PROCESSES_WITHOUT_CGROUP = 4  # without one: each gets memory_mb / 4 of address space


def memory_cgroup() -> pathlib.Path | None:
  """The cgroup v2 directory under which each run gets a memory cgroup of its own: this
  process's cgroup, when the memory controller is enabled for its children and it may create
  them (a container's own cgroup namespace, or a delegated cgroup); None otherwise."""
  try:
    with open("/proc/self/cgroup") as f:
      path = next(line[3:].strip() for line in f if line.startswith("0::"))
    with open("/proc/self/mountinfo") as f:
      mounts = [line.split() for line in f]
    mount = next(fields[4] for fields in mounts
                 if fields[fields.index("-") + 1] == "cgroup2")
  except (OSError, StopIteration, ValueError):
    return None
  base = pathlib.Path(mount) / path.lstrip("/")
  try:
    enabled = (base / "cgroup.subtree_control").read_text().split()
  except OSError:
    return None
  return base if "memory" in enabled and os.access(base, os.W_OK) else None


def memory_limit(memory_mb: int, cgroup: pathlib.Path | None) -> dict:
  """How a run's ``memory_mb`` is enforced: one cgroup for the whole run (its children, page
  cache, memfd and shared memory counted), or, without one, few enough processes that their
  address spaces together stay within it."""
  if cgroup is not None:
    return {"how": f"cgroup v2 memory.max={memory_mb} MiB for the whole run (under {cgroup})",
            "processes": _PROCESSES, "process_mb": memory_mb}
  return {"how": (f"no memory cgroup available: at most {_PROCESSES_WITHOUT_CGROUP} processes "
                  f"of {memory_mb // _PROCESSES_WITHOUT_CGROUP} MiB address space each "
                  f"({memory_mb} MiB in all); memfd and shared memory refused"),
          "processes": _PROCESSES_WITHOUT_CGROUP,
          "process_mb": memory_mb // _PROCESSES_WITHOUT_CGROUP}


class _RunCgroup:
  """A cgroup of one run under ``base``: memory.max = ``memory_mb`` without swap, pids.max,
  removed after the run (the jail joins it before it forks)."""

  def __init__(self, base: pathlib.Path | None, memory_mb: int, processes: int):
    self.path = None
    if base is None:
      return
    path = base / f"rlx-sandbox-{secrets.token_hex(6)}"
    path.mkdir()
    self.path = path
    (path / "memory.max").write_text(str(memory_mb << 20))
    for name, value in (("memory.swap.max", "0"), ("pids.max", str(processes))):
      if (path / name).exists():
        (path / name).write_text(value)

  def remove(self) -> None:
    if self.path is None:
      return
    for _ in range(50):  # the namespace's last processes die asynchronously
      try:
        self.path.rmdir()
        return
      except OSError as error:
        if error.errno != errno.EBUSY:
          return
        time.sleep(0.02)
