"""Scoring responses in a pool of host worker processes, off the device path.

    with RewardPool("arithmetic", format_weight=0.1, num_workers=2, timeout_s=5) as pool:
        scored = pool.score(responses, references)
        scored.rewards, scored.correct, scored.counts

Every call has its own timeout: a call that runs past ``timeout_s`` scores 0,
is counted (``reward/timeouts``) and only its worker is killed and replaced. A
reward function that raises scores 0 and is counted (``reward/errors``); so
does one that kills its own process (the worker is replaced). The first
failure of each kind is logged; the run goes on.

The pool is safe to share between threads (the generator and the evaluation):
a ``score`` call checks workers out for its own use and returns them when done.
Workers ignore SIGINT and SIGTERM, which a terminal or a cluster scheduler sends
to the whole process group: the trainer decides when they stop (``close``).
``num_workers=0`` scores in the calling thread (no timeouts), for debugging.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from rlx.rewards.verifiers import VERIFIERS, judge

log = logging.getLogger(__name__)

_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_STARTUP_S = 120.0  # a worker process that is not up by then (a very loaded host) is replaced


class Scored(NamedTuple):
  """What one ``RewardPool.score`` call returns."""

  rewards: np.ndarray
  """float32 [N]: the verifier's reward plus the weighted format reward."""
  correct: np.ndarray
  """bool [N]: the verifier's verdict alone (a format bonus never makes an answer correct)."""
  counts: dict
  """This call's ``reward/errors`` and ``reward/timeouts``."""


def _serve(connection) -> None:
  """A worker's loop: (verifier, format_weight, response, reference) in, ("ok", (reward,
  correct)) or ("error", text) out, until the parent sends None or goes away."""
  for sig in _STOP_SIGNALS:
    signal.signal(sig, signal.SIG_IGN)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
  _die_with_parent()
  connection.send(("ready", None))  # a call's clock starts only once its worker is up
  while True:
    try:
      task = connection.recv()
    except (EOFError, OSError):  # the parent is gone
      return
    if task is None:
      return
    try:
      reply = ("ok", judge(*task))
    except Exception as error:  # noqa: BLE001 - any reward failure is reported, never fatal
      reply = ("error", f"{type(error).__name__}: {error}")
    try:
      connection.send(reply)
    except (OSError, ValueError):
      return


def _die_with_parent() -> None:
  """Exits this worker when the trainer is gone, even if it died by SIGKILL and the worker is
  stuck in a reward function: a watchdog thread polls the parent's pid."""
  parent = os.getppid()

  def watch():
    while os.getppid() == parent:
      time.sleep(1.0)
    os._exit(0)

  threading.Thread(target=watch, name="rlx-reward-watchdog", daemon=True).start()


class _Worker:
  """One worker process and the parent's end of its pipe."""

  def __init__(self, context):
    self.connection, child = context.Pipe()
    self.process = context.Process(target=_serve, args=(child,), daemon=True,
                                   name="rlx-reward-worker")
    # Started with SIGINT/SIGTERM blocked, so that the child (which inherits the mask) never
    # dies of a Ctrl-C that arrives before it has installed its own handlers.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
      self.process.start()
    finally:
      signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    child.close()
    self.ready = False
    self.index = -1  # the position of the response this worker is scoring, -1 when idle
    self.started = time.monotonic()  # of the process until ready, then of the current call

  def kill(self) -> None:
    self.process.kill()
    self.process.join(timeout=5)
    self.connection.close()

  def stop(self, timeout: float) -> None:
    try:
      self.connection.send(None)
    except (OSError, ValueError):
      pass
    self.process.join(timeout=timeout)
    if self.process.is_alive():
      self.process.kill()
      self.process.join(timeout=5)
    self.connection.close()


class RewardPool:
  """A verifier applied to (response, reference) pairs in worker processes.

  ``verifier`` is a name in ``VERIFIERS`` or a module-level function
  ``(response, reference) -> float`` (workers import it by name).
  """

  def __init__(self, verifier, *, format_weight: float = 0.0, num_workers: int = 2,
               timeout_s: float = 5.0):
    if isinstance(verifier, str) and verifier not in VERIFIERS:
      raise ValueError(f"unknown reward {verifier!r}; choose one of {', '.join(VERIFIERS)}")
    if timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    self.verifier, self.format_weight = verifier, format_weight
    self.num_workers, self.timeout_s = num_workers, timeout_s
    self.totals = {"reward/errors": 0, "reward/timeouts": 0}
    self._lock = threading.Lock()  # guards totals, the logged-once flags and closing
    self._logged: set[str] = set()
    self._closed = False
    # spawn, not fork: the parent runs JAX's threads, which fork does not copy safely.
    self._context = multiprocessing.get_context("spawn")
    self._idle: queue.Queue[_Worker] = queue.Queue()
    for _ in range(num_workers):
      self._idle.put(_Worker(self._context))
    if num_workers:
      # before multiprocessing's own exit handler, which would wait forever on workers that
      # ignore the SIGTERM it sends them
      atexit.register(self.close)

  def score(self, responses: Sequence[str], references: Sequence[str]) -> Scored:
    """Rewards, verdicts and this call's error and timeout counts."""
    if len(responses) != len(references):
      raise ValueError(f"{len(responses)} responses but {len(references)} references")
    counts = {"reward/errors": 0, "reward/timeouts": 0}
    rewards = np.zeros(len(responses), np.float32)
    correct = np.zeros(len(responses), bool)
    tasks = [(self.verifier, self.format_weight, response, reference)
             for response, reference in zip(responses, references)]
    if not self.num_workers:
      for i, task in enumerate(tasks):
        try:
          rewards[i], correct[i] = judge(*task)
        except Exception as error:  # noqa: BLE001 - any reward failure scores 0
          self._failed(counts, "reward/errors", f"{type(error).__name__}: {error}")
    elif tasks:
      self._score_in_workers(tasks, rewards, correct, counts)
    with self._lock:
      for key, value in counts.items():
        self.totals[key] += value
    return Scored(rewards, correct, counts)

  def _checkout(self) -> list[_Worker]:
    """At least one worker (waiting for one if another thread holds them all), and every
    other idle one."""
    while True:
      if self._closed:
        raise RuntimeError("the reward pool is closed")
      try:
        workers = [self._idle.get(timeout=0.5)]
        break
      except queue.Empty:
        continue
    while True:
      try:
        workers.append(self._idle.get_nowait())
      except queue.Empty:
        return workers

  def _score_in_workers(self, tasks, rewards, correct, counts) -> None:
    workers = self._checkout()
    pending = list(range(len(tasks)))[::-1]  # popped from the end: in order
    try:
      while pending or any(w.index >= 0 for w in workers):
        for worker in workers:
          if worker.ready and worker.index < 0 and pending:
            worker.index, worker.started = pending.pop(), time.monotonic()
            try:
              worker.connection.send(tasks[worker.index])
            except (OSError, ValueError):  # it died while idle: the call goes back in line
              pending.append(worker.index)
              self._replace(workers, worker)
        waiting = [w for w in workers if not w.ready or w.index >= 0]
        deadline = min(w.started + (self.timeout_s if w.ready else _STARTUP_S) for w in waiting)
        ready = multiprocessing.connection.wait([w.connection for w in waiting],
                                                timeout=max(deadline - time.monotonic(), 0))
        for worker in [w for w in waiting if w.connection in ready]:
          try:
            status, value = worker.connection.recv()
          except (EOFError, OSError):  # the reward function killed its own process
            if worker.index >= 0:
              self._failed(counts, "reward/errors",
                           f"a reward worker died (exit code {worker.process.exitcode})")
            self._replace(workers, worker)
            continue
          if status == "ready":
            worker.ready = True
            continue
          if status == "ok":
            rewards[worker.index], correct[worker.index] = value
          else:
            self._failed(counts, "reward/errors", f"a reward function raised {value}")
          worker.index = -1
        now = time.monotonic()
        for worker in [w for w in waiting if w in workers]:  # not those just replaced
          if worker.connection.poll():  # answered since the wait: read on the next round
            continue
          if worker.ready and worker.index >= 0 and now - worker.started > self.timeout_s:
            self._failed(counts, "reward/timeouts",
                         f"a reward call ran past {self.timeout_s:.1f}s; its worker was replaced")
            self._replace(workers, worker)
          elif not worker.ready and now - worker.started > _STARTUP_S:
            log.warning("a reward worker did not start within %.0fs; starting another",
                        _STARTUP_S)
            self._replace(workers, worker)
    finally:
      for worker in workers:
        if self._closed:
          worker.stop(timeout=2)
        elif worker.index >= 0:  # interrupted mid-call: its answer would confuse the next caller
          worker.kill()
          self._idle.put(_Worker(self._context))
        else:
          self._idle.put(worker)

  def _replace(self, workers: list[_Worker], worker: _Worker) -> None:
    """Kills ``worker`` and puts a fresh one in its place in ``workers``."""
    worker.kill()
    workers[workers.index(worker)] = _Worker(self._context)

  def _failed(self, counts: dict, key: str, message: str) -> None:
    counts[key] += 1
    with self._lock:
      first = key not in self._logged
      self._logged.add(key)
    if first:
      log.warning("%s; it scores 0 (further %s are only counted)", message,
                  key.split("/")[-1])

  def close(self) -> None:
    """Stops the workers (those busy in another thread's call are killed)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    atexit.unregister(self.close)
    while True:
      try:
        self._idle.get_nowait().stop(timeout=2)
      except queue.Empty:
        return

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
