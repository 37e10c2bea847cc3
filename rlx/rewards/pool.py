"""Scoring responses in a pool of host worker processes, off the device path.

    with RewardPool(RewardFn("arithmetic", format_weight=0.1), num_workers=2, timeout_s=5) as pool:
        scored = pool.score(responses, rows)
        scored.rewards, scored.correct, scored.counts, scored.components

Every call has its own timeout: a call that runs past ``timeout_s`` scores 0, is counted
(``reward/timeouts``) and only its worker is killed and replaced. A reward function that raises
(or calls ``sys.exit``) scores 0 and is counted (``reward/errors``); so does one that kills its
own process or runs out of its ``memory_mb`` (the worker is replaced, as is a worker that has
grown past it between calls). Processes a reward call starts end with the call: each worker is
its own process group and the subreaper of its calls' orphans, kills what a call left behind
when the call returns, is killed with every process below it on a timeout (those in sessions of
their own too), and kills them itself when the trainer dies, by any signal. What a reward
function prints goes to ``log_path`` (a run's ``WORKDIR/reward.log``), else nowhere. The first
failure of each kind is logged; the run goes on. A batched reward function is called on chunks
of ``batch_size`` responses, each chunk one call with its own timeout.

The pool is safe to share between threads (the generator and the evaluation):
a ``score`` call checks workers out for its own use and returns them when done.
Workers ignore SIGINT and SIGTERM, which a terminal or a cluster scheduler sends
to the whole process group: the trainer decides when they stop (``close``).
``num_workers=0`` scores in the calling thread (no timeouts, prints shown), for debugging.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import queue
import resource
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from rlx.hostmem import resident_bytes
from rlx.rewards.functions import RewardFn, check, judge, judge_batch

log = logging.getLogger(__name__)

_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_STARTUP_S = 120.0  # a worker process that is not up by then (a very loaded host) is replaced


class Scored(NamedTuple):
  """What one ``RewardPool.score`` call returns."""

  rewards: np.ndarray
  """float32 [N]: the reward plus the weighted format reward."""
  correct: np.ndarray
  """bool [N]: the verdict alone (a format bonus never makes an answer correct)."""
  counts: dict
  """This call's ``reward/errors`` and ``reward/timeouts``."""
  components: dict
  """name -> float32 [N]: the named parts a reward returned (NaN where it gave none)."""


LOG_CAP_BYTES = 64 << 20
"""What reward functions print stops being kept once their log file is this large."""


def _redirect_output(log_path: str | None) -> int:
  """Points the worker's stdout and stderr at ``log_path`` (appended to; None: nowhere);
  returns the descriptor."""
  target = (os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if log_path
            else os.open(os.devnull, os.O_WRONLY))
  os.dup2(target, 1)
  os.dup2(target, 2)
  return target


def _serve(connection, reward: RewardFn, memory_mb: int, log_path: str | None = None) -> None:
  """A worker's loop: (positions, payload) in, ("ok", [Judged]) or ("error", text) out, until
  the parent sends None or goes away. The payload is (response, row), or (responses, rows)
  for a batched function. What the reward prints goes to ``log_path`` (up to
  ``LOG_CAP_BYTES``), else nowhere."""
  for sig in _STOP_SIGNALS:
    signal.signal(sig, signal.SIG_IGN)
  _die_with_parent()
  _adopt_orphans()
  log = _redirect_output(log_path)
  limit = memory_mb * 2**20
  if memory_mb:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  connection.send(("ready", None, False))  # a call's clock starts only once its worker is up
  while True:
    try:
      task = connection.recv()
    except (EOFError, OSError):  # the parent is gone
      return
    if task is None:
      _kill_descendants()
      return
    if log_path and os.fstat(log).st_size > LOG_CAP_BYTES:
      sys.stdout.flush()
      os.write(log, f"rlx: {log_path} is past {LOG_CAP_BYTES >> 20} MiB; what reward functions "
               "print is no longer kept\n".encode())
      log, log_path = _redirect_output(None), None
    try:
      _, payload = task
      judged = (judge_batch(reward, *payload) if reward.batched else [judge(reward, *payload)])
      reply = ("ok", judged)
    except BaseException as error:  # noqa: BLE001 - any reward failure (exit too) is reported
      reply = ("error", f"{type(error).__name__}: {error}")
    _kill_descendants()  # what the call started ends with it
    retire = bool(memory_mb) and resident_bytes() > limit // 2  # it leaks: a fresh one takes over
    try:
      connection.send((*reply, retire))
    except (OSError, ValueError):
      return
    if retire:
      return


_PR_SET_CHILD_SUBREAPER = 36


def _adopt_orphans() -> None:
  """Makes this worker its own process group and, on Linux, the subreaper of whatever a
  reward function starts: a child that daemonizes (double fork, ``setsid``) is re-parented
  here, not to init, so ``_kill_descendants`` finds it, and the parent's ``killpg`` takes
  down what stayed in the group when it kills this worker."""
  os.setpgid(0, 0)
  try:
    import ctypes  # noqa: PLC0415 - Linux only
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
  except (OSError, AttributeError):
    pass


def _children(pid: int) -> list[int]:
  """The pids whose parent is ``pid``."""
  found = []
  try:
    for task in os.listdir(f"/proc/{pid}/task"):
      with open(f"/proc/{pid}/task/{task}/children") as f:
        found.extend(int(child) for child in f.read().split())
    return found
  except OSError:  # no /proc/<pid>/task/*/children: every process's parent, from its stat
    pass
  for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat") as f:
          if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
      except (OSError, ValueError, IndexError):
        continue
  return found


def _descendants(pid: int) -> list[int]:
  """Every process below ``pid`` (children, theirs, ...), read from /proc."""
  found, todo = [], [pid]
  while todo and len(found) < 10_000:
    children = _children(todo.pop())
    found += children
    todo += children
  return found


def _kill_tree(pid: int) -> None:
  """Kills the worker ``pid`` and every process its calls started, those that left its
  process group (``setsid``) too: found as its descendants before it dies, not after, when
  they would belong to init."""
  for below in _descendants(pid):
    try:
      os.kill(below, signal.SIGKILL)
    except OSError:
      pass
  try:
    os.killpg(pid, signal.SIGKILL)
  except OSError:  # not yet its own group
    os.kill(pid, signal.SIGKILL)


def _kill_descendants() -> None:
  """Kills every process this worker's reward calls left behind (children, and orphans
  re-parented here) and reaps them, until none is left."""
  me = os.getpid()
  for _ in range(100):
    children = _children(me)
    if not children:
      return
    for pid in children:
      try:
        os.kill(pid, signal.SIGKILL)
      except OSError:
        pass
    for pid in children:  # their orphans come to this worker as they die
      try:
        os.waitpid(pid, 0)
      except ChildProcessError:
        pass


def _die_with_parent() -> None:
  """Exits this worker when the trainer is gone, even if it died by SIGKILL and the worker is
  stuck in a reward function: a watchdog thread polls the parent's pid, and kills what the
  worker's calls started (in any session: they are its descendants) before it exits."""
  parent = os.getppid()

  def watch():
    while os.getppid() == parent:
      time.sleep(1.0)
    try:
      _kill_descendants()
    finally:
      os._exit(0)

  threading.Thread(target=watch, name="rlx-reward-watchdog", daemon=True).start()


def _start_ignoring_stop_signals(process) -> None:
  """Starts ``process`` so that it cannot die of a Ctrl-C (SIGINT, SIGTERM to the process
  group) that arrives before it has installed its own handlers, seconds later on a loaded
  machine: the stop signals are ignored while it starts, a disposition that survives the
  spawn's exec (a blocked signal mask does not). Only the main thread may change signal
  dispositions; elsewhere (a worker restarted by a scoring thread) it just starts. The
  parent ignores the stop signals for the few milliseconds of the start."""
  handlers = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
  if (threading.current_thread() is not threading.main_thread()
      or any(handler is None for handler in handlers.values())):  # set outside Python
    process.start()
    return
  for sig in _STOP_SIGNALS:
    signal.signal(sig, signal.SIG_IGN)
  try:
    process.start()
  finally:
    for sig, handler in handlers.items():
      signal.signal(sig, handler)


class _Worker:
  """One worker process and the parent's end of its pipe."""

  def __init__(self, context, reward: RewardFn, memory_mb: int, log_path: str | None = None):
    self.connection, child = context.Pipe()
    self.process = context.Process(target=_serve, args=(child, reward, memory_mb, log_path),
                                   daemon=True, name="rlx-reward-worker")
    _start_ignoring_stop_signals(self.process)
    child.close()
    self.ready = False
    self.index = -1  # the position of the response this worker is scoring, -1 when idle
    self.started = time.monotonic()  # of the process until ready, then of the current call

  def kill(self) -> None:
    """Kills the worker and every process its reward call started (``_kill_tree``)."""
    try:
      _kill_tree(self.process.pid)
    except (OSError, TypeError):  # never started
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
      self.kill()
      return
    self.connection.close()


class RewardPool:
  """A reward applied to (response, row) pairs in worker processes.

  ``reward`` is a ``RewardFn``, or what its ``name`` may be: a name in ``VERIFIERS``,
  ``"code"``, ``"module:function"`` / ``"file.py:function"``, or a module-level function
  ``(response, row) -> float | dict`` (workers import it by name).
  """

  def __init__(self, reward, *, format_weight: float = 0.0, num_workers: int = 2,
               timeout_s: float = 5.0, memory_mb: int = 4096, batch_size: int = 64,
               log_path: str | os.PathLike | None = None):
    if not isinstance(reward, RewardFn):
      reward = RewardFn(reward, format_weight=format_weight)
    check(reward)  # an unknown name or an import error is reported here, not in a worker
    if timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    self.reward, self.memory_mb, self.batch_size = reward, memory_mb, batch_size
    self.log_path = None if log_path is None else str(log_path)
    if log_path is not None:  # a worker opens it first thing: its directory must be there
      pathlib.Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    """Where the workers' reward functions print to (None: nowhere)."""
    self.num_workers, self.timeout_s = num_workers, timeout_s
    self.totals = {"reward/errors": 0, "reward/timeouts": 0}
    self._lock = threading.Lock()  # guards totals, the logged-once flags and closing
    self._logged: set[str] = set()
    self.first_error: str | None = None
    """The first failure's message (an error or a timeout), for the stop message."""
    self._closed = False
    # spawn, not fork: the parent runs JAX's threads, which fork does not copy safely.
    self._context = multiprocessing.get_context("spawn")
    self._idle: queue.Queue[_Worker] = queue.Queue()
    for _ in range(num_workers):
      self._idle.put(self._new_worker())
    if num_workers:
      # before multiprocessing's own exit handler, which would wait forever on workers that
      # ignore the SIGTERM it sends them
      atexit.register(self.close)

  def _new_worker(self) -> _Worker:
    return _Worker(self._context, self.reward, self.memory_mb, self.log_path)

  def score(self, responses: Sequence[str], rows: Sequence[dict | str]) -> Scored:
    """Rewards, verdicts, this call's error and timeout counts, and the named components. A
    row given as a string is the reference answer alone."""
    if len(responses) != len(rows):
      raise ValueError(f"{len(responses)} responses but {len(rows)} rows")
    rows = [{"answer": row} if isinstance(row, str) else
            {key: value for key, value in row.items() if key != "prompt_tokens"} for row in rows]
    counts = {"reward/errors": 0, "reward/timeouts": 0}
    rewards = np.zeros(len(responses), np.float32)
    correct = np.zeros(len(responses), bool)
    components: dict[str, np.ndarray] = {}
    if self.reward.batched:
      tasks = [(list(range(start, min(start + self.batch_size, len(rows)))),
                (list(responses[start:start + self.batch_size]),
                 rows[start:start + self.batch_size]))
               for start in range(0, len(rows), self.batch_size)]
    else:
      tasks = [([i], (response, row)) for i, (response, row) in enumerate(zip(responses, rows))]

    def record(positions, judged_list):
      for i, judged in zip(positions, judged_list):
        with np.errstate(over="ignore"):
          reward = np.float32(judged.reward)
        if not np.isfinite(reward):  # 1e39 is inf in float32: an error, never a reward
          self._failed(counts, "reward/errors",
                       f"a reward function returned {judged.reward!r}, not a finite float32")
          continue
        rewards[i], correct[i] = reward, judged.correct
        for name, value in judged.components.items():
          components.setdefault(name, np.full(len(responses), np.nan, np.float32))[i] = value

    if not self.num_workers:
      for positions, payload in tasks:
        try:
          record(positions, judge_batch(self.reward, *payload) if self.reward.batched
                 else [judge(self.reward, *payload)])
        except Exception as error:  # noqa: BLE001 - any reward failure scores 0
          self._failed(counts, "reward/errors", f"{type(error).__name__}: {error}",
                       len(positions))
    elif tasks:
      self._score_in_workers(tasks, record, counts)
    with self._lock:
      for key, value in counts.items():
        self.totals[key] += value
    return Scored(rewards, correct, counts, components)

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

  def _score_in_workers(self, tasks, record, counts) -> None:
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
            status, value, retire = worker.connection.recv()
          except (EOFError, OSError):  # the reward function killed its own process
            if worker.index >= 0:
              self._failed(counts, "reward/errors",
                           f"a reward worker died (exit code {worker.process.exitcode})",
                           len(tasks[worker.index][0]))
            self._replace(workers, worker)
            continue
          if status == "ready":
            worker.ready = True
            continue
          if status == "ok":
            record(tasks[worker.index][0], value)
          else:
            self._failed(counts, "reward/errors", f"a reward function raised {value}",
                         len(tasks[worker.index][0]))
          worker.index = -1
          if retire:
            self._replace(workers, worker)
        now = time.monotonic()
        for worker in [w for w in waiting if w in workers]:  # not those just replaced
          if worker.connection.poll():  # answered since the wait: read on the next round
            continue
          if worker.ready and worker.index >= 0 and now - worker.started > self.timeout_s:
            self._failed(counts, "reward/timeouts",
                         f"a reward call ran past {self.timeout_s:.1f}s; its worker was replaced",
                         len(tasks[worker.index][0]))
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
          self._idle.put(self._new_worker())
        else:
          self._idle.put(worker)

  def _replace(self, workers: list[_Worker], worker: _Worker) -> None:
    """Kills ``worker`` and puts a fresh one in its place in ``workers``."""
    worker.kill()
    workers[workers.index(worker)] = self._new_worker()

  def _failed(self, counts: dict, key: str, message: str, responses: int = 1) -> None:
    counts[key] += responses
    with self._lock:
      first = key not in self._logged
      self._logged.add(key)
      self.first_error = self.first_error or message
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
