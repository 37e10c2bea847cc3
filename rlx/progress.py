"""What this process is doing, and when it last got something done: the record a job's status
file carries, so that a peer can tell a working job from a hung one whose heartbeat thread still
beats (``rlx.trainer.deploy.jobstatus``).

    progress.doing("sampling rollout 12")   # a new stage of work: counts as progress
    progress.tick()                         # a unit of work done (a decode chunk, an update)
    progress.waiting("the learner job")     # blocked on a peer, not on itself; cleared by either
    progress.snapshot()                     # {"doing", "progress_at", "waiting_on", "ticks"}
    with progress.running("the update step"):   # a device program, dispatch to result
      ...

Work anywhere in the process ticks: every decode chunk of the engine's driver (rollouts,
evaluations, episodes), every learner update, every reward scored, and a compile in flight
(``rlx.compilation``) counts as progress while it runs. A stage that gets nothing done past a
job's timeout while not waiting on its peer is a hang (a reward call or environment that never
returns, a deadlocked collective).

A device program that runs far longer than it ever took before (``running``) is a collective
its devices wait at in different orders: on a multi-device CPU mesh XLA would end the process
after ``rlx.main.COLLECTIVE_PATIENCE_S`` with a screen of rendezvous messages; the watchdog
ends it first, with one line naming the program and the stage (``Watchdog(programs_s=...)``).
"""

from __future__ import annotations

import contextlib
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


_programs: dict[str, tuple[str, float]] = {}
"""The device program each thread runs now (by thread name), and since when."""
_longest: dict[str, float] = {}
"""Each program's longest run without a compile in it, once it has run without one."""
STUCK_FACTOR = 10.0
"""A program is stuck past this many times its longest run before (and ``STUCK_FLOOR_S``)."""
STUCK_FLOOR_S = 30.0
"""...and past this many seconds, so that a loaded machine's slow step is never called stuck."""
_seen: set[str] = set()
"""The programs that have run once (a first run compiles, whatever the compile counts say)."""


@contextlib.contextmanager
def running(program: str):
  """The calling thread runs the device program ``program`` (a short name: "the update step"),
  from its dispatch to its result; how long it takes is remembered for the watchdog, unless a
  compile ran meanwhile (its first run compiles)."""
  from rlx import compilation

  thread = threading.current_thread().name
  started, compiled = time.time(), compilation.totals()["programs"]
  with _lock:
    _programs[thread] = (program, started)
  try:
    yield
  finally:
    took = time.time() - started
    with _lock:
      _programs.pop(thread, None)
      if compilation.totals()["programs"] == compiled and program in _seen:
        _longest[program] = max(_longest.get(program, 0.0), took)
      _seen.add(program)



def stuck_after(longest: float, ceiling_s: float) -> float:
  """How long a program whose longest run took ``longest`` may run: ``STUCK_FACTOR`` times
  that, but no longer than ``ceiling_s`` (the collective timeout's margin) unless that is under
  three times it, and never under ``STUCK_FLOOR_S``."""
  return max(min(STUCK_FACTOR * longest, ceiling_s), 3 * longest, STUCK_FLOOR_S)


def stuck_program(now: float, ceiling_s: float) -> str | None:
  """A line naming a device program that runs far past its longest run (``stuck_after``),
  with its thread's stage; None when none does. A compile in flight is no one's hang, and a
  program's time counts from the last compile's end (a new batch shape compiles mid-run)."""
  from rlx import compilation

  if compilation.compiling() is not None:
    return None
  compiled = compilation.finished_at()
  with _lock:
    for thread, (program, started) in _programs.items():
      longest = _longest.get(program)
      ran = now - max(started, compiled)
      if longest is not None and ran > stuck_after(longest, ceiling_s):
        where = _stages.get(thread, "")
        return (f"{program} has run for {ran:.0f}s where it took at most {longest:.1f}s before"
                + (f" ({where})" if where else ""))
  return None


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
  while not waiting on a peer, or, with ``programs_s``, once a device program runs far past its
  longest run (``stuck_program``: a collective deadlock on a multi-device CPU mesh, ended
  before XLA's own abort; ``programs_s`` is how long XLA lets a collective wait, less a
  margin). A context manager; ``timeout_s`` 0 watches nothing but programs."""

  def __init__(self, timeout_s: float, interval_s: float | None = None,
               on_hang: Callable[[str], None] = _end_hung,
               clock: Callable[[], float] = time.time, programs_s: float = 0.0):
    self.timeout_s, self.on_hang, self.clock = timeout_s, on_hang, clock
    self.programs_s = programs_s
    every = min(30.0, max(0.1, timeout_s / 10)) if timeout_s > 0 else 30.0
    self.interval_s = (min(every, 5.0) if programs_s else every) if interval_s is None \
        else interval_s
    self._stop = threading.Event()
    self._thread = None

  def check(self) -> bool:
    """Looks once; calls ``on_hang`` and returns True when the process hangs."""
    if self.programs_s:
      stuck = stuck_program(self.clock(), self.programs_s)
      if stuck is not None:
        self.on_hang(f"rlx: error: {stuck}: its devices wait at a collective they reached in "
                     "different orders (a deadlock); ending the run. Every thread's stack "
                     "follows; the newest checkpoint resumes it")
        return True
    if self.timeout_s <= 0:
      return False
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
    if self.timeout_s > 0 or self.programs_s:
      self._thread = threading.Thread(target=self._run, name="rlx-watchdog", daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
