"""Loading and saving a Hugging Face checkpoint from two processes sharing one mesh."""

import pathlib
import socket
import subprocess
import sys

import pytest

# several processes with their own ports and cores: one such test at a time (pytest -n)
pytestmark = pytest.mark.xdist_group("processes")

ROOT = pathlib.Path(__file__).parents[2]


def test_two_processes_load_sharded_and_save(hf_dir, tmp_path):
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  script = pathlib.Path(__file__).parent / "multihost_save.py"
  procs = [subprocess.Popen([sys.executable, str(script), f"localhost:{port}", str(i),
                             str(hf_dir("qwen2")), str(tmp_path / "out")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
  assert "multihost save ok" in outputs[0]
