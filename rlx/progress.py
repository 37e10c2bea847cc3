"""What this process is doing, and when it last got something done: the record a job's status
file carries, so that a peer can tell a working job from a hung one whose heartbeat thread still
beats (``rlx.trainer.jobstatus``).

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

import threading
import time

_lock = threading.Lock()
_state = {"doing": "starting", "progress_at": time.time(), "waiting_on": None, "ticks": 0}


def doing(what: str) -> None:
  """Starts the stage ``what`` (a short phrase: "training on rollout 12"): progress."""
  with _lock:
    _state.update(doing=what, progress_at=time.time(), waiting_on=None)
    _state["ticks"] += 1


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
  compiling = compilation.compiling()
  if compiling is not None:
    record.update(progress_at=time.time(), doing=f"{record['doing']} (compiling {compiling})")
  return record
