"""The persistent compilation cache: a second process loads what the first compiled."""

import json
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
