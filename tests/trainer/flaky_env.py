"""Environments for tests/trainer/test_loops.py: the built-in calculator whose reset fails on
one row in five (as a user's environment that cannot load some rows does), and one whose
first message is long (as tool schemas make it)."""

import os
import subprocess
import threading
import zlib

from rlx.envs.builtin import make_calc


class _Flaky:
  def __init__(self, row):
    self.inner, self.row = make_calc(row), row
    self.tools = self.inner.tools

  def reset(self):
    if zlib.crc32(self.row["prompt"].encode()) % 5 == 0:
      raise FileNotFoundError("no fixture for this row")
    return self.inner.reset()

  def step(self, text):
    return self.inner.step(text)


def make_env(row):
  return _Flaky(row)


class _Verbose(_Flaky):
  def reset(self):  # a long preamble before the row's question, as tool schemas can be
    first = self.inner.reset()
    return [dict(first[0], content="Think step by step. " * 20 + first[0]["content"]),
            *first[1:]]


def make_verbose_env(row):
  return _Verbose(row)


class _Stuck(_Flaky):
  def reset(self):  # never returns on one row in five
    if zlib.crc32(self.row["prompt"].encode()) % 5 == 0:
      threading.Event().wait()
    return self.inner.reset()

  def step(self, text):  # and never answers one turn in three
    if zlib.crc32(text.encode()) % 3 == 0:
      threading.Event().wait()
    return self.inner.step(text)


def make_stuck_env(row):
  return _Stuck(row)


class _Hung(_Flaky):
  def reset(self):  # never returns, on any row
    threading.Event().wait()


def make_hung_env(row):
  return _Hung(row)


class _Broken(_Flaky):
  def reset(self):  # raises on every row
    raise ConnectionError("the simulator is not running")


def make_broken_env(row):
  return _Broken(row)


class _Forking(_Flaky):
  """Starts a sleeping process in a session of its own at every reset (as an environment that
  launches a simulator does) and writes its pid to ``$RLX_TEST_PIDS``."""

  def reset(self):
    sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    with open(os.environ["RLX_TEST_PIDS"], "a") as pids:
      pids.write(f"{sleeper.pid}\n")
    return self.inner.reset()

  def step(self, text):
    return self.inner.step(text)


def make_forking_env(row):
  return _Forking(row)
