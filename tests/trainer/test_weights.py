"""The weights a producer holds: a background read never stalls decoding, its version is
taken whole at a later call and never moves back, and its error reaches the caller."""

import threading
import time

import pytest

from rlx.trainer.produce.loop import Weights


class Storage:
  """Published versions; a read blocks until the test lets it through."""

  def __init__(self):
    self.newest = -1
    self.gate = threading.Event()
    self.gate.set()
    self.reads = self.finished = 0
    self.error: Exception | None = None

  def latest(self, newer_than: int):
    self.reads += 1
    self.gate.wait(5)
    if self.error is not None:
      raise self.error
    found = self.newest
    self.finished += 1
    return None if found <= newer_than else (f"params-{found}", found)


def _settle(weights: Weights) -> None:
  weights._reading.join(5)  # the read under way has finished


def test_a_background_read_never_holds_up_the_caller_and_lands_at_a_later_call():
  storage = Storage()
  weights = Weights(storage.latest, background=True)
  storage.newest = 3
  storage.gate.clear()  # storage is slow
  started = time.perf_counter()
  assert weights() == (None, -1)  # starts the read, does not wait for it
  assert weights() == (None, -1)  # still reading: one read at a time
  assert time.perf_counter() - started < 1.0 and storage.reads == 1
  storage.gate.set()
  _settle(weights)
  assert weights() == ("params-3", 3) and weights.swaps == 1
  assert weights.seconds < 1.0  # the caller never waited for storage


def test_a_forced_refresh_waits_for_the_read_under_way_and_reads_the_newest():
  storage = Storage()
  weights = Weights(storage.latest, background=True)
  storage.newest = 1
  weights()
  _settle(weights)
  storage.newest = 2
  weights()  # takes 1, starts a read
  storage.newest = 4
  assert weights.refresh(force=True)
  assert (weights.params, weights.version) == ("params-4", 4)


def test_a_read_that_finds_an_older_version_than_the_one_held_is_dropped():
  storage = Storage()
  weights = Weights(storage.latest, background=True)
  storage.newest = 2
  storage.gate.clear()
  weights()  # a read of version 2 under way, slow
  # a forced refresh elsewhere took 5 meanwhile (the caller's own read)
  weights.params, weights.version = "params-5", 5
  storage.gate.set()
  _settle(weights)
  assert weights() == ("params-5", 5)


def test_a_read_that_lands_with_the_version_already_held_is_no_swap():
  storage = Storage()
  weights = Weights(storage.latest, background=True)
  storage.newest = 5
  storage.gate.clear()
  weights()  # a read from version -1 under way, slow: it will find 5
  weights.params, weights.version = "params-5", 5  # the caller took 5 by itself meanwhile
  storage.gate.set()
  _settle(weights)
  assert weights() == ("params-5", 5) and weights.swaps == 0  # not taken again, not counted


def test_what_a_background_read_raises_the_next_call_raises():
  storage = Storage()
  weights = Weights(storage.latest, background=True)
  storage.error = OSError("storage went away")
  weights()
  _settle(weights)
  with pytest.raises(OSError, match="storage went away"):
    weights()


def test_close_waits_for_the_read_under_way():
  storage = Storage()
  weights = Weights(storage.latest, background=True)
  storage.newest = 1
  storage.gate.clear()
  weights()
  threading.Timer(0.2, storage.gate.set).start()
  weights.close()
  assert storage.finished == 1 and weights._reading is None


def test_without_background_a_call_reads_in_the_caller_at_most_every_poll():
  storage = Storage()
  weights = Weights(storage.latest, poll_s=60.0)
  storage.newest = 1
  assert weights() == ("params-1", 1)
  storage.newest = 2
  assert weights() == ("params-1", 1) and storage.reads == 1  # within the poll interval
  assert weights.refresh(force=True) and weights.version == 2


def test_ask_starts_a_read_at_once_whatever_the_poll_interval():
  storage = Storage()
  weights = Weights(storage.latest, poll_s=60.0, background=True)
  storage.newest = 1
  weights()  # the first call reads (nothing checked yet)
  _settle(weights)
  assert weights() == ("params-1", 1)
  storage.newest = 2
  assert weights() == ("params-1", 1) and storage.reads == 1  # within the poll interval
  assert not weights.ask() and storage.reads == 2  # the learner showed 2: read now
  _settle(weights)
  assert weights.ask() and weights.version == 2


def test_going_back_to_an_earlier_version_drops_the_read_under_way():
  """The learner resumed from an earlier checkpoint: the producer holds the version it names,
  older than its own, and a read started before that never lands over it."""
  storage = Storage()
  weights = Weights(storage.latest, background=True)
  storage.newest = 5
  weights.refresh(force=True)
  assert weights.version == 5
  storage.newest, storage.gate = 7, threading.Event()  # a slow read of version 7 starts
  weights.ask()
  storage.gate.set()
  weights.go_back(("params-2", 2))
  assert (weights.params, weights.version) == ("params-2", 2)
  assert weights._reading is None and not weights.refresh()  # nothing from the dropped read
  weights.go_back(None)
  assert (weights.params, weights.version) == (None, -1)
