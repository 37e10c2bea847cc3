"""The one producer loop of split mode, for the generator thread and the generator job.

    produce(run, gate, weights, sink, first=index)

It mirrors the learner loop (``rlx.trainer.learn.loop``); deployments differ only in their gate and
their sink:

- ``split.ThreadGate`` / ``split.QueueSink`` (split in one process): the learner's progress
  comes through a condition variable, batches go through a bounded queue;
- ``jobs.FileGate`` / ``jobs.FileSink`` (the generator job): progress and the controller's
  knobs come from the rollout directory, agreed across the job's processes, and batches go
  out as rollout files.

One pass, for batch ``index``:

1. wait at the gate until ``control.may_start(index, finished, k)``: the learner is done
   with batch ``index - k`` (the gate also returns the controller's sampling temperature);
2. take the newest published weights;
3. collect the batch (``collect.collect``). With ``mesh.inflight_updates`` the weights are
   asked for again before every decode chunk: a version published meanwhile reaches the
   sequences in flight, each token stamped with the version that sampled it; otherwise
   they change only between dynamic sampling's draws;
4. every ``logging.mismatch_every``-th batch, measure the engine/learner mismatch
   (``rollout/mismatch_kl``) on its rows sampled wholly by the weights held at the end;
5. hand it to the sink with what it cost (sync, wait and busy seconds).

The loop ends when the gate says stop (returns None); what it raises (the data ran out:
``StopIteration``; a failed reward) goes to the caller.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Protocol

from rlx import progress
from rlx.trainer.produce.collect import collect
from rlx.trainer.common import due
from rlx.trainer.draw import Draw
from rlx.trainer.setup.run import Run


@dataclasses.dataclass(frozen=True)
class Opened:
  """What the gate says when it opens for a batch."""

  setting: int
  """How many staleness changes the controller had made: a batch started under an earlier
  one says nothing about the current k."""
  temperature: float | None = None
  """The sampling temperature a controller set; None: ``rollout.temperature``."""


@dataclasses.dataclass
class Produced:
  """A batch and what it cost the producer."""

  index: int
  draw: Draw
  setting: int
  sync_seconds: float
  """Seconds spent taking new weights for this batch (before it and in flight)."""
  waited_seconds: float
  """Seconds at the gate before it started."""
  busy_seconds: float
  """Seconds from its start to its hand-over (sampling, scoring, the mismatch measure)."""
  weight_swaps: int
  """In-flight weight updates taken while it was sampled."""


class Gate(Protocol):
  def wait(self, index: int, timeout: float | None = None) -> Opened | None | bool:
    """Blocks until batch ``index`` may start; None: stop producing. With ``timeout``, False
    once that many seconds passed without it opening (0: only look; continuous admission
    asks so between decode chunks)."""


class Sink(Protocol):
  def put(self, produced: Produced) -> None:
    """Hands a batch over (may block while the learner is behind)."""


class Weights:
  """The newest published policy a producer holds: ``(params, version)`` when called,
  refreshed from ``latest(newer_than)`` (a ``WeightSync.latest``) at most every
  ``poll_s`` seconds.

  ``background``: a call never waits for storage. It starts a read in a thread of its own
  and takes what that read found at a later call, so decoding goes on under the held
  version while the next one loads (a generator job reading Orbax versions: seconds for a
  real model). A forced refresh still reads in the caller. What the read raises, the next
  call raises."""

  def __init__(self, latest: Callable[[int], tuple | None], poll_s: float = 0.0,
               background: bool = False):
    self._latest, self.poll_s, self.background = latest, poll_s, background
    self.params, self.version = None, -1
    self.seconds = 0.0
    """Seconds the caller spent waiting for weights so far (reads in the background left
    out)."""
    self.swaps = 0
    """Versions taken so far."""
    self._checked = float("-inf")
    self._reading: threading.Thread | None = None
    self._found = None  # what the finished background read returned, or the error it raised

  def refresh(self, force: bool = False) -> bool:
    """Takes the newest published version if newer than the one held; returns whether it did.
    Background, not forced: takes what a finished read found and starts the next read once
    ``poll_s`` has passed."""
    now = time.perf_counter()
    took = self._take(wait=force) if self.background else False
    if self.background and not force:
      if self._reading is None and now - self._checked >= self.poll_s:
        self._start()
      self.seconds += time.perf_counter() - now
      return took
    if not force and now - self._checked < self.poll_s:
      return False
    self._checked = now
    newer = self._latest(self.version)
    self.seconds += time.perf_counter() - now
    return self._swap(newer) or took

  def ask(self) -> bool:
    """Background: takes what a finished read found, and starts the next read now whatever
    ``poll_s`` (the caller knows of a newer version); returns whether it took one."""
    took = self._take(wait=False)
    if self._reading is None:
      self._start()
    return took

  def _start(self) -> None:
    self._checked = time.perf_counter()
    self._reading = threading.Thread(target=self._read, args=(self.version,),
                                     name="rlx-weights", daemon=True)
    self._reading.start()

  def _read(self, version: int) -> None:
    try:
      self._found = self._latest(version)
    except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
      self._found = error

  def _take(self, wait: bool) -> bool:
    """Takes what a finished background read found (waiting for one under way if ``wait``)."""
    if self._reading is None or (self._reading.is_alive() and not wait):
      return False
    self._reading.join()
    self._reading, found, self._found = None, self._found, None
    if isinstance(found, BaseException):
      raise found
    return self._swap(found)

  def _swap(self, newer: tuple | None) -> bool:
    if newer is None or newer[1] <= self.version:
      return False
    self.params, self.version = newer
    self.swaps += 1
    return True

  def go_back(self, held: tuple | None) -> None:
    """Holds ``held`` = ``(params, version)`` (None: nothing) even if older than the version
    held now: the learner resumed from an earlier checkpoint, and the newer versions are gone.
    A read under way is waited for and dropped."""
    self.close()
    self.params, self.version = held or (None, -1)

  def close(self) -> None:
    """Waits for a read under way (before the sync it reads from closes)."""
    if self._reading is not None:
      self._reading.join()
      self._reading = self._found = None

  def __call__(self) -> tuple:
    self.refresh()
    return self.params, self.version


def measure_mismatch(mismatch, every: int, batch: int, weights: Weights, draw: Draw) -> None:
  """On every ``every``-th batch a producer hands over (``logging.mismatch_every``), the
  engine/learner mismatch on the draw's rows sampled wholly by the weights held now
  (``experience.make_mismatch``'s measure), as ``rollout/mismatch_kl`` in its counts."""
  if mismatch is None or not due(every, batch):
    return
  measured = mismatch(weights.params, draw.completions, weights.version, draw.temperature)
  if measured is not None:
    draw.counts["rollout/mismatch_kl"] = measured[0]


def produce(run: Run, gate: Gate, weights: Weights, sink: Sink, *, first: int = 0,
            stride: int = 1, mismatch=None, mismatch_every: int = 0,
            delay_s: float = 0.0, collect_fn=collect) -> int:
  """Produces batches ``first``, ``first + stride``, ... until the gate says stop; returns
  the next index. ``mismatch``: ``experience.make_mismatch``'s measure; ``delay_s`` slows
  every batch down on purpose (tests and benchmarks of the staleness control);
  ``collect_fn``: ``collect`` (a fake in tests of the gate)."""
  config, index = run.config, first
  inflight = config.mesh.inflight_updates
  while True:
    waiting = time.perf_counter()
    opened = gate.wait(index)
    if opened is None:
      return index
    started = time.perf_counter()
    progress.doing(f"sampling and scoring rollout {index}")
    synced = weights.seconds
    weights.refresh(force=True)
    swaps = weights.swaps
    draw = collect_fn(run, weights, seed=config.trainer.seed * 1_000_003 + index,
                   temperature=opened.temperature, inflight=weights if inflight else None)
    if delay_s:
      time.sleep(delay_s)
    measure_mismatch(mismatch, mismatch_every, index // stride, weights, draw)
    sink.put(Produced(index, draw, opened.setting, sync_seconds=weights.seconds - synced,
                      waited_seconds=started - waiting,
                      busy_seconds=time.perf_counter() - started,
                      weight_swaps=weights.swaps - swaps))
    index += stride
