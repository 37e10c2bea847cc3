"""Helpers for tests that count the processes a run leaves behind."""

import os
import signal
import time


def alive(pid: int) -> bool:
  """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def left_after(pids, seconds: float) -> list[int]:
  """The ``pids`` still running after up to ``seconds``; they are then killed, so that a failed
  test leaves nothing behind either."""
  deadline = time.monotonic() + seconds
  while any(map(alive, pids)) and time.monotonic() < deadline:
    time.sleep(0.05)
  left = [p for p in pids if alive(p)]
  for pid in left:
    try:
      os.kill(pid, signal.SIGKILL)
    except OSError:
      pass
  return left
