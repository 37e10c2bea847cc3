"""The multi-controller helpers (rlx.distributed) across 2 processes: agreement, reductions,
global arrays from each process's rows and back, a process-local replica, and the divergence
guard; and the built-in model's FSDP training step at its default size, whose collectives
overlapped in different orders on the two processes, and gloo aborted, until each process
ran on one core of its own."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest

# several processes with their own ports and cores: one such test at a time (pytest -n)
pytestmark = pytest.mark.xdist_group("processes")

ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.parametrize("worker, says", [("distributed_worker.py", "distributed ok"),
                                           ("distributed_fsdp_worker.py", "fsdp warm-up ok")])
def test_two_processes(worker, says):
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  script = pathlib.Path(__file__).parent / worker
  # XLA at its full optimisation level (tests/conftest.py lowers it): the FSDP step's collectives
  # overlapped only there, as in a real run
  env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(
      "--xla_backend_optimization_level=0", ""))
  procs = [subprocess.Popen([sys.executable, str(script), f"localhost:{port}", str(i)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True) for i in range(2)]
  outputs = []
  try:
    outputs = [p.communicate(timeout=120)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
  reports = [[line.split(": ", 1)[1] for line in out.splitlines()
              if line.startswith(f"process {i}: {says}")] for i, out in enumerate(outputs)]
  assert reports[0] and reports[0] == reports[1], reports  # the same losses on both
