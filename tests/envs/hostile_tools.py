"""Tools that misbehave, for tests/envs/test_tools.py (imported by name in tool workers)."""

import os
import subprocess
import sys
import time


def raises(x: str) -> str:
  """Raises."""
  raise RuntimeError(f"tool broke on {x}")


def hangs(x: str) -> str:
  """Never returns."""
  while True:
    time.sleep(1)


def exits(x: str) -> str:
  """Kills its own process."""
  os._exit(3)


def floods(x: str) -> str:
  """Returns 10 MB."""
  return "y" * (10 * 2**20)


def not_text(x: str) -> str:
  """Returns a number."""
  return 42  # type: ignore[return-value]


def forks(x: str) -> str:
  """Leaves a process behind that would write a file later."""
  subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(1.5); open({x!r}, 'w')"],
                   start_new_session=True)
  return "forked"


def hogs(x: str) -> str:
  """Allocates 2 GB at once: past the test's 1 GB limit, it fails at the allocation, before
  touching a page (blocks touched one by one took the whole timeout on a loaded machine)."""
  block = bytearray(2**31)
  return str(len(block))


def echo(x: str) -> str:
  """Echoes its argument."""
  return x


def forks_and_returns(x: str) -> str:
  """Forks; both copies return (the copy would go on serving the worker's later calls)."""
  os.fork()
  return f"forked {x}"


def spawns_and_hangs(x: str) -> str:
  """Starts a process in a session of its own (its pid written to ``x``), then hangs."""
  child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                           start_new_session=True)
  with open(x, "w") as f:
    f.write(str(child.pid))
  time.sleep(120)
  return "never"


def sleeps(x: str) -> str:
  """Sleeps x seconds."""
  time.sleep(float(x))
  return x
