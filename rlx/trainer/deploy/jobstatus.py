"""Each job of a split run says whether it is alive: ``WORKDIR/jobs/<role>-<id>.json``.

    with JobStatus(workdir, "generator", 0) as status:   # running, with a heartbeat thread
      ...                                                # finished / stopped / failed on exit
    problem = silent_or_failed("the generator job", read_status(workdir, "generator", 0),
                               now=time.time(), since=started, timeout_s=120)  # None: fine

A status file holds the job's state (``running``, ``finished``, ``stopped`` or ``failed``),
the first line of its error, its host and pid, a heartbeat: the wall-clock time, rewritten
every ``HEARTBEAT_S`` seconds by a thread while the job runs, whatever the job is doing, and
its progress (``rlx.progress``): what it is doing, when it last got something done (a decode
chunk, an update, a reward, a compile), and whether it is waiting on its peer.

A job that waits on another (the learner on the generator whose rollout file is next, a
generator on its learner) asks ``silent_or_failed`` and stops with its answer when it has
one: the other job failed, or died on this host without a word (a kill: its process is gone
for ``DEAD_GRACE_S``, time for a restart to take its place), or has been silent past
``mesh.job_timeout_s`` (a lost host), or beats but has got nothing done past it while not
waiting on its peer (a hung process: a reward call or an environment that never returns).
The decision is a pure function of
the status files and the clock, so tests drive it with made-up files.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import threading
import time

from rlx import progress

HEARTBEAT_S = 2.0
"""How often a running job rewrites its heartbeat."""
DEAD_GRACE_S = 20.0
"""How long a job on this host may have no live process before it counts as dead (a
restarted job writes its status once it is up)."""
RUNNING, FINISHED, STOPPED, FAILED = "running", "finished", "stopped", "failed"


def status_path(workdir: str | pathlib.Path, role: str, job: int) -> pathlib.Path:
  return pathlib.Path(workdir) / "jobs" / f"{role}-{job}.json"


class JobStatus:
  """This job's status file (see the module docstring); a context manager that writes
  ``running`` on entry, beats while inside, and writes how the job ended on exit: ``failed``
  with the error's first line when an exception leaves it, else ``stopped`` when
  ``stopped`` was set, else ``finished``."""

  def __init__(self, workdir: str | pathlib.Path, role: str, job: int = 0):
    self.path = status_path(workdir, role, job)
    self.role, self.job = role, job
    self.stopped = False
    self.started = time.time()
    self._halt = threading.Event()
    self._lock = threading.Lock()
    self._state, self._error = RUNNING, None
    self._thread = threading.Thread(target=self._beat, name="rlx-heartbeat", daemon=True)

  def _write(self) -> None:
    record = {"role": self.role, "id": self.job, "state": self._state, "error": self._error,
              "host": socket.gethostname(), "pid": os.getpid(), "started": self.started,
              "heartbeat": time.time(), **progress.snapshot()}
    partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
    with self._lock:
      try:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(record))
        partial.replace(self.path)  # readers never see half a file
      except OSError:
        pass  # a full or vanished disk: the job's own error says so, not its heartbeat

  def _beat(self) -> None:
    while not self._halt.wait(HEARTBEAT_S):
      self._write()

  def __enter__(self) -> JobStatus:
    self._write()
    self._thread.start()
    return self

  def __exit__(self, kind, error, traceback) -> None:
    self._halt.set()
    self._thread.join(timeout=5)
    if error is not None:
      self._state = FAILED
      line = str(error).strip().splitlines()
      self._error = f"{kind.__name__}: {line[0] if line else ''}".rstrip(": ")
    else:
      self._state = STOPPED if self.stopped else FINISHED
    self._write()


def read_status(workdir: str | pathlib.Path, role: str, job: int = 0) -> dict | None:
  """The status of job ``job`` of ``role`` (None: no status file yet)."""
  try:
    return json.loads(status_path(workdir, role, job).read_text())
  except (OSError, ValueError):
    return None


def _alive(pid: int) -> bool:
  """Whether process ``pid`` of this host runs (a zombie, dead but not yet reaped, does not)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  try:
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return True  # no /proc here: the signal's answer stands
  return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def silent_or_failed(name: str, status: dict | None, *, now: float, since: float,
                     timeout_s: float, host: str | None = None,
                     alive=_alive) -> str | None:
  """Why the job ``name`` will never deliver (a sentence), or None while it may.

  ``status``: its status file (None: none yet); ``since``: when the asking job started
  waiting for it to exist; ``host``: this host's name (a job on it whose process is gone is
  dead; elsewhere only its heartbeat tells).
  """
  host = socket.gethostname() if host is None else host
  if status is None:
    if now - since > timeout_s:
      return (f"{name} has not started after {now - since:.0f}s (no status file; "
              f"config.mesh.job_timeout_s={timeout_s:g}): start it, or check its log")
    return None
  state, beat = status.get("state"), float(status.get("heartbeat", 0.0))
  if state == FAILED:
    return f"{name} failed: {status.get('error') or 'no error message'}"
  silent = now - beat
  if state == STOPPED and silent > timeout_s:
    return (f"{name} stopped {silent:.0f}s ago and has not restarted (config.mesh."
            f"job_timeout_s={timeout_s:g}): rerun it to resume")
  if state != RUNNING:
    return None  # finished, or stopped a moment ago: what it wrote is there to read
  if status.get("host") == host and not alive(int(status.get("pid", -1))):
    if silent > DEAD_GRACE_S:
      return (f"{name} died without a word (its process {status.get('pid')} is gone, last "
              f"heard {silent:.0f}s ago: killed, or out of memory?); check its log, restart it")
    return None
  if silent > timeout_s:
    return (f"{name} has been silent for {silent:.0f}s (config.mesh.job_timeout_s="
            f"{timeout_s:g}): its host is lost or the process hangs; check its log")
  stalled = beat - float(status.get("progress_at", beat))
  if status.get("waiting_on") is None and stalled > timeout_s:
    where = f" on {status['host']}" if status.get("host") != host else ""
    return (f"{name} hangs: it has got nothing done for {stalled:.0f}s while "
            f"{status.get('doing', 'working')} (its heartbeat still beats; config.mesh."
            f"job_timeout_s={timeout_s:g}). `kill -USR1 {status.get('pid')}`{where} prints "
            "what each of its threads is doing")
  return None
