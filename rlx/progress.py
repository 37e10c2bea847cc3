"""What this process is doing, and when it last got something done: the record a job's status
file carries, so that a peer can tell a working job from a hung one whose heartbeat thread still
beats (``rlx.trainer.deploy.jobstatus``).

    progress.doing("sampling rollout 12")   # a new stage of work: counts as progress
    progress.tick()                         # a unit of work done (a decode chunk, an update)
    progress.waiting("the learner job")     # blocked on a peer, not on itself; cleared by either
    progress.snapshot()                     # {"doing", "progress_at", "waiting_on", "ticks"}

Work anywhere in the process ticks: every decode chunk of the engine's driver (rollouts,
evaluations, episodes), every learner update, every reward scored, and a compile in flight
(``rlx.compilation``) counts as progress while it runs. A stage that gets nothing done past a
job's timeout while not waiting on its peer is a hang (a reward call or environment that never
returns, a deadlocked collective).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Self

_lock = threading.Lock()
_state = {"doing": "starting", "progress_at": time.time(), "waiting_on": None, "ticks": 0}
_stages: dict[str, str] = {}
"""Each thread's own stage (by thread name): a learner and a generator thread of one process
each say what they are doing, and a hang names both."""


def doing(what: str) -> None:
  """Starts the stage ``what`` (a short phrase: "training on rollout 12") of the calling
  thread: progress."""
  with _lock:
    _stages[threading.current_thread().name] = what
    _state.update(doing=what, progress_at=time.time(), waiting_on=None)
    _state["ticks"] += 1


def _stage_of_each_thread() -> str | None:
  """The stage of the one live thread that has one, or "the main thread: ...; rlx-generator:
  ..." when several have; None when none has."""
  live = {thread.name for thread in threading.enumerate()}
  stages = [(name, what) for name, what in _stages.items() if name in live]
  if len(stages) < 2:
    return stages[0][1] if stages else None
  return "; ".join(f"{'the main thread' if name == 'MainThread' else name}: {what}"
                   for name, what in stages)


def tick() -> None:
  """A unit of work done in the current stage."""
  with _lock:
    _state.update(progress_at=time.time(), waiting_on=None)
    _state["ticks"] += 1


def waiting(on: str) -> None:
  """Blocked on ``on`` (a peer: "the learner job"): no progress is expected until it delivers."""
  with _lock:
    if _state["waiting_on"] != on:
      _state.update(waiting_on=on, progress_at=time.time())


def snapshot() -> dict:
  """The record (a copy); a compile in flight counts as progress at this moment."""
  from rlx import compilation

  with _lock:
    record = dict(_state)
    each = _stage_of_each_thread()
  if each is not None:
    record["doing"] = each
  compiling = compilation.compiling()
  if compiling is not None:
    record.update(progress_at=time.time(), doing=f"{record['doing']} (compiling {compiling})")
  return record


EXIT_HUNG = 70
"""The exit status of a run that ``Watchdog`` ended (EX_SOFTWARE): not a requeue's 75."""


def hung_for(record: dict, now: float) -> float | None:
  """Seconds ``record`` (a ``snapshot``) has got nothing done while not waiting on a peer;
  None while it waits."""
  return None if record["waiting_on"] is not None else now - record["progress_at"]


def _end_hung(message: str) -> None:
  print(message, file=sys.stderr, flush=True)
  faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
  sys.stderr.flush()
  os._exit(EXIT_HUNG)  # the hung thread would never let an exception through


class Watchdog:
  """A thread that ends the process (``on_hang``: by default a line naming the stage, every
  thread's stack, exit status ``EXIT_HUNG``) once it has got nothing done for ``timeout_s``
  while not waiting on a peer. A context manager; ``timeout_s`` 0 watches nothing."""

  def __init__(self, timeout_s: float, interval_s: float | None = None,
               on_hang: Callable[[str], None] = _end_hung,
               clock: Callable[[], float] = time.time):
    self.timeout_s, self.on_hang, self.clock = timeout_s, on_hang, clock
    self.interval_s = min(30.0, max(0.1, timeout_s / 10)) if interval_s is None else interval_s
    self._stop = threading.Event()
    self._thread = None

  def check(self) -> bool:
    """Looks once; calls ``on_hang`` and returns True when the process hangs."""
    record = snapshot()
    stalled = hung_for(record, self.clock())
    if stalled is None or stalled <= self.timeout_s:
      return False
    self.on_hang(f"rlx: error: this process has got nothing done for {stalled:.0f}s while "
                 f"{record['doing']} (config.trainer.hang_timeout_s={self.timeout_s:g}): it "
                 "hangs; ending the run. Every thread's stack follows; the newest checkpoint "
                 "resumes it")
    return True

  def _run(self) -> None:
    while not self._stop.wait(self.interval_s):
      if self.check():
        return

  def __enter__(self) -> Self:
    if self.timeout_s > 0:
      self._thread = threading.Thread(target=self._run, name="rlx-watchdog", daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
