"""The reaper: whatever a run started, in a session of its own, ends when the run ends, by
every path (return, exception, exit 70, SIGTERM, SIGINT, SIGKILL)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from rlx import reaper
from tests.processes import alive, left_after

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")

# A stand-in for the trainer: tags itself, starts a daemon in its own session (as an environment
# may), says its pid, then ends as argv[1] says.
_RUN = r"""
import os, signal, subprocess, sys, time
from rlx import reaper
from tests.processes import alive, left_after
reaper.start()
daemon = subprocess.Popen(["sleep", "300"], start_new_session=True)
grandchild = subprocess.Popen(["sh", "-c", "setsid sleep 300 & echo $!"], stdout=subprocess.PIPE,
                              text=True)
print(daemon.pid, grandchild.stdout.readline().strip(), flush=True)
end = sys.argv[1]
if end == "return":
  sys.exit(0)
if end == "raise":
  raise RuntimeError("the run failed")
if end == "exit70":
  os._exit(70)
time.sleep(300)  # until a signal
"""


@pytest.mark.parametrize("end", ["return", "raise", "exit70", "SIGTERM", "SIGINT", "SIGKILL"])
def test_what_a_run_started_in_its_own_session_ends_with_it(end):
  run = subprocess.Popen([sys.executable, "-c", _RUN, end], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
  pids = [int(p) for p in run.stdout.readline().split()]
  assert len(pids) == 2 and all(map(alive, pids))
  if end.startswith("SIG"):
    run.send_signal(getattr(signal, end))
  run.wait(30)
  assert not left_after(pids, 10), f"outlived the run ({end})"


def test_the_reaper_kills_only_its_own_runs_processes():
  mine = subprocess.Popen(["sleep", "300"], env=dict(os.environ, **{reaper.TAG: "one"}))
  other = subprocess.Popen(["sleep", "300"], env=dict(os.environ, **{reaper.TAG: "two"}))
  try:
    deadline = time.monotonic() + 10
    while mine.pid not in reaper.tagged("one") and time.monotonic() < deadline:
      time.sleep(0.01)  # until the exec has replaced the environment
    assert reaper.tagged("one") == [mine.pid]
    assert reaper.reap("one") == 1
    assert mine.wait(5) == -signal.SIGKILL
    assert other.poll() is None
  finally:
    other.kill()
    other.wait()
