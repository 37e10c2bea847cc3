"""The hang watchdog: a process that gets nothing done past ``trainer.hang_timeout_s`` while not
waiting on a peer ends loudly, with every thread's stack, instead of holding its devices."""

import subprocess
import sys
import textwrap

from rlx import progress


def test_the_watchdog_fires_only_past_the_timeout_and_never_while_waiting():
  now = [0.0]
  hangs = []
  dog = progress.Watchdog(10.0, on_hang=hangs.append, clock=lambda: now[0])
  progress.doing("training on rollout 3")
  start = progress.snapshot()["progress_at"]
  now[0] = start + 9
  assert not dog.check() and not hangs
  now[0] = start + 11
  assert dog.check()
  assert "training on rollout 3" in hangs[0] and "trainer.hang_timeout_s=10" in hangs[0]
  progress.waiting("the checkpoint write")  # a peer's or the storage's time, not a hang
  now[0] = progress.snapshot()["progress_at"] + 1000
  assert not dog.check()
  progress.tick()  # work again: the clock restarts
  now[0] = progress.snapshot()["progress_at"] + 5
  assert not dog.check() and len(hangs) == 1


def test_a_hung_process_ends_with_its_stacks_and_exit_status_70():
  script = textwrap.dedent("""
      import time
      from rlx import progress

      def stuck_in_a_call_that_never_returns():
        time.sleep(60)

      progress.doing("scoring rewards")
      with progress.Watchdog(0.5, interval_s=0.1):
        stuck_in_a_call_that_never_returns()
  """)
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=50, check=False)
  assert done.returncode == progress.EXIT_HUNG, done
  assert "has got nothing done" in done.stderr and "while scoring rewards" in done.stderr
  assert "stuck_in_a_call_that_never_returns" in done.stderr  # the hung thread's stack


def test_a_zero_timeout_watches_nothing():
  with progress.Watchdog(0) as dog:
    assert dog._thread is None
