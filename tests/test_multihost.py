"""rlx.main as two processes joined by jax.distributed (CPU collectives over gloo): the runtime
starts, and the training loops, which drive one process for now, refuse clearly."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent


def test_two_processes_share_one_mesh(tmp_path):
  env = dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
  result = subprocess.run(
      ["bash", "launch/local.sh", "2", "--config", "configs/grpo_colocated.py", "--workdir",
       str(tmp_path), "--config.mesh.cpu_devices=2", "--config.mesh.tensor=2",
       "--config.model.arch.num_layers=2"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 2, result.stdout + result.stderr
  assert "4 cpu devices in 2 process(es)" in result.stdout
  assert result.stdout.count("cpu devices in 2 process(es)") == 1  # only process 0 reports
  assert result.stderr.count("the training loops drive one process for now") == 2
  assert "Traceback" not in result.stderr
  assert json.loads((tmp_path / "config.json").read_text())["mesh"]["multihost"] is True
