"""Nothing a run started outlives it: the run's processes carry a tag, and a reaper kills every
process that carries it once the run has ended, by any path (return, exception, the
watchdog's exit, a signal, SIGKILL).

    reaper.start()          # first thing in ``python -m rlx.main``; nothing else to call

What it covers: processes that a user's environment, reward or tool starts, in any session
or process group (``setsid``, double forks), whose parent may be long gone. Rewards' and
tools' workers already kill their calls' descendants themselves (``rlx.rewards.pool``); an
environment runs in the trainer's own threads, so what it starts is the trainer's child, and
when the trainer is SIGKILLed nothing of it runs to clean up: its orphans go to init. Linux
gives no way to keep them from within the dying process: a child subreaper must be an
ancestor, and a parent-death signal is set by the child itself. A cgroup would hold them all,
but a run seldom may create one. So the trainer tags its environment (``RLX_RUN_TAG``, a
random id), which every process it starts inherits whatever session it moves to, and starts
the reaper: a small process in a session of its own (no terminal or group signal reaches it)
that waits for the trainer to end (the pipe it holds closes; its parent changes), then
kills every process whose environment holds the tag, until none is left. A process that
starts with an environment of its own, without the tag, escapes it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid

TAG = "RLX_RUN_TAG"
POLL_S = 1.0
"""How often the reaper looks at its parent, beside waiting for the pipe to close."""


def start() -> subprocess.Popen | None:
  """Tags this process's environment for what it starts and starts the reaper (Linux with
  /proc only; elsewhere nothing). Returns the reaper."""
  if not sys.platform.startswith("linux") or not os.path.isdir("/proc/self"):
    return None
  tag = uuid.uuid4().hex
  read, write = os.pipe()  # the write end stays here (not inherited): closed when we end
  environ = {k: v for k, v in os.environ.items() if k != TAG}  # the reaper is untagged
  reaper = subprocess.Popen([sys.executable, "-m", "rlx.reaper", str(os.getpid()), tag],
                            stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=environ, close_fds=True)
  os.close(read)
  _kept.append(write)
  os.environ[TAG] = tag
  return reaper


_kept: list[int] = []


def tagged(tag: str) -> list[int]:
  """The pids of the processes whose environment holds ``TAG=tag`` (those we may read)."""
  needle = f"{TAG}={tag}".encode()
  found = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/environ", "rb") as f:
        if needle in f.read().split(b"\0"):
          found.append(int(entry))
    except OSError:  # gone, or another user's
      continue
  return found


def reap(tag: str, rounds: int = 50) -> int:
  """Kills every tagged process, again until none is left (a dying one may have forked);
  returns how many were killed."""
  killed = set()
  for _ in range(rounds):
    alive = [pid for pid in tagged(tag) if pid != os.getpid() and not _zombie(pid)]
    if not alive:
      break
    for pid in alive:
      try:
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
      except OSError:
        pass
    time.sleep(0.05)
  return len(killed)


def _zombie(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"
  except (OSError, IndexError):
    return True


def _wait_for_end(parent: int) -> None:
  """Returns once ``parent`` has ended: its end of our stdin closed, or we were re-parented."""
  while os.getppid() == parent:
    ready, _, _ = select.select([0], [], [], POLL_S)
    if ready and not os.read(0, 1):
      return


if __name__ == "__main__":
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, signal.SIG_IGN)
  _wait_for_end(int(sys.argv[1]))
  reap(sys.argv[2])
