"""The multi-controller helpers (rlx.distributed) across 2 processes: agreement, reductions,
global arrays from each process's rows and back, a process-local replica, and the divergence
guard."""

import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent


def test_helpers_across_two_processes():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  script = pathlib.Path(__file__).parent / "distributed_worker.py"
  procs = [subprocess.Popen([sys.executable, str(script), f"localhost:{port}", str(i)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True) for i in range(2)]
  outputs = []
  try:
    outputs = [p.communicate(timeout=120)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
  assert all(f"process {i}: distributed ok" in out for i, out in enumerate(outputs))
