"""The persistent compilation cache: a second process loads what the first compiled; a
multi-process CPU job runs without it."""

import json
import os
import subprocess
import sys

PROGRAM = """
import json, sys
import jax, jax.numpy as jnp
from rlx import compilation
compilation.start(sys.argv[1])
jax.jit(lambda x: jnp.sin(x) @ x.T + 1)(jnp.ones((8, 8))).block_until_ready()
jax.jit(lambda x: jnp.cumsum(x, 0))(jnp.ones((4,))).block_until_ready()
print(json.dumps(compilation.totals()))
"""


def _run(cache):
  out = subprocess.run([sys.executable, "-c", PROGRAM, str(cache)], capture_output=True, text=True,
                       check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_loads_compiled_programs_from_the_cache(tmp_path):
  first = _run(tmp_path / "cache")
  assert first["programs"] >= 2 and first["from_cache"] == 0
  assert any((tmp_path / "cache").iterdir())
  second = _run(tmp_path / "cache")
  assert second["programs"] == first["programs"]
  assert second["from_cache"] == second["programs"]
  off = _run("")
  assert off["from_cache"] == 0 and off["programs"] == first["programs"]


def test_a_multi_process_cpu_job_compiles_without_the_cache(monkeypatch, capsys):
  """JAX writes the cache from process 0 and every process reads it; on CPU, a job whose
  processes mixed loaded and freshly compiled programs ran mismatched gloo collectives and
  aborted at its first RL step on every warm rerun (5 of 5 here), so such a job runs with the
  cache off. One process, or an accelerator, keeps it."""
  from rlx import cli, compilation, distributed, main

  monkeypatch.setattr(compilation, "_directory", compilation.directory())
  monkeypatch.setattr(distributed, "initialize", lambda: None)
  config = cli.apply_overrides(cli.load_config_file("configs/grpo_colocated.py"),
                               ["--config.mesh.multihost=true",
                                "--config.trainer.compile_cache=/tmp/rlx-test-cache"])
  monkeypatch.setattr(distributed, "cpu_only", lambda: True)
  main.start_jax(config)
  assert compilation.directory() is None
  assert "compile_cache is off for a multi-process CPU job" in capsys.readouterr().out
  monkeypatch.setattr(distributed, "cpu_only", lambda: False)  # GPU or TPU processes
  seen = []
  monkeypatch.setattr(compilation, "start", seen.append)
  main.start_jax(config)
  assert seen == ["/tmp/rlx-test-cache"]


SLOW = """
import sys
import jax, jax.numpy as jnp
from rlx import compilation
compilation.start("")
compilation.report_progress(lambda line: print(line, flush=True), after_s=0.0)

def slow_to_compile(x):
  for i in range(4000):
    x = jnp.sin(x * 1.0001 + i)
  return x

jax.jit(slow_to_compile)(jnp.ones((4,))).block_until_ready()
"""


def test_a_long_compile_says_which_program_it_is():
  # XLA:CPU's loop emitters (the suite's, tests/conftest.py) recurse once per op of this
  # 4000-op chain and overflow the stack: the default emitters compile it
  flags = os.environ.get("XLA_FLAGS", "").replace("--xla_cpu_use_fusion_emitters=false", "")
  out = subprocess.run([sys.executable, "-c", SLOW], capture_output=True, text=True, check=True,
                       timeout=300, env=dict(os.environ, XLA_FLAGS=flags))
  lines = [line for line in out.stdout.splitlines() if line.startswith("rlx: compiling ")]
  assert lines and "slow_to_compile" in lines[0], out.stdout
  assert "programs compiled before it" in lines[0]
  # JAX's own debug record of the compile is used, never printed
  assert "with global shapes" not in out.stdout + out.stderr


def test_cpu_collectives_wait_longer_than_xlas_40_seconds_unless_the_user_says():
  # XLA:CPU ends the process when a collective's devices arrive 40 s apart (measured: a
  # psum whose device 0 slept 45 s aborted with "Termination timeout ... of 40 seconds")
  from rlx import main

  environ = {}
  main.patient_collectives(environ)
  assert (f"--xla_cpu_collective_call_terminate_timeout_seconds={main.COLLECTIVE_PATIENCE_S}"
          in environ["XLA_FLAGS"])
  assert "--xla_cpu_collective_call_warn_stuck_timeout_seconds=60" in environ["XLA_FLAGS"]
  mine = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2 "
                       "--xla_cpu_collective_call_terminate_timeout_seconds=5"}
  main.patient_collectives(mine)
  assert "terminate_timeout_seconds=5 " in mine["XLA_FLAGS"] + " "
  assert f"={main.COLLECTIVE_PATIENCE_S}" not in mine["XLA_FLAGS"]
  assert mine["XLA_FLAGS"].startswith("--xla_force_host_platform_device_count=2")
  again = dict(environ)
  main.patient_collectives(again)  # idempotent
  assert again == environ
