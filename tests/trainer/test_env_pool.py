"""The thread pool that runs environment steps: a quick step never waits behind slow ones."""

import threading
import time

from rlx.trainer.episodes import _DaemonPool


def test_a_quick_step_does_not_queue_behind_slow_ones_and_threads_start_as_needed():
  pool = _DaemonPool(8, "test-env")
  assert pool.threads == 0  # none until work comes
  release = threading.Event()
  slow = [pool.submit(release.wait) for _ in range(4)]  # four steps waiting on their tools
  began = time.perf_counter()
  assert pool.submit(lambda: "answer").result(timeout=5) == "answer"
  assert time.perf_counter() - began < 1.0
  assert pool.threads == 5
  release.set()
  assert all(f.result(timeout=5) for f in slow)
  # idle threads take the next calls: no new ones
  assert [pool.submit(lambda i=i: i).result(timeout=5) for i in range(5)] == list(range(5))
  assert pool.threads == 5
  pool.shutdown()


def test_the_bound_holds_and_work_past_it_waits_for_a_thread():
  pool = _DaemonPool(2, "test-env")
  release = threading.Event()
  held = [pool.submit(release.wait) for _ in range(2)]
  queued = pool.submit(lambda: 7)
  time.sleep(0.2)
  assert not queued.done() and pool.threads == 2
  release.set()
  assert queued.result(timeout=5) == 7 and all(f.result(timeout=5) for f in held)
  pool.shutdown()
  assert pool.submit(lambda: 1).cancelled()
