"""The Tinker service's queue of calls: every call that computes is queued and answered at
once with a future id; a worker thread runs the queue in order, and takes every queued
sampling call of the same batch key (the same weights and settings) together.

    queue.submit(fn, model_id)                  # {"request_id": ...}
    queue.retrieve(request_id)                  # a dict, protobuf bytes, or "try again"

Split (``WorkQueue(split=True)``): two lanes, each with its own worker, so that sampling runs
beside training (the service puts each lane on devices of its own). The training lane runs
every call but sampling, in order; the sampling lane runs the sampling calls, in order. A
sampling call never waits for a training call queued before it: what it samples from is
already there when it is queued (a base, or a sampler checkpoint whose save has finished: the
service checks the path as the call comes), and sampling changes no training state.
"""

import collections
import dataclasses
import itertools
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Hashable

from rlx.tinker import wire
from rlx.tinker.training import BadInput

log = logging.getLogger(__name__)

POLL_S = 40.0
"""How long ``retrieve_future`` holds a request for a result before the SDK asks again (its
own timeout for the call is 45 s; each "try again" is a warning line on its side)."""
KEPT_FUTURES = 4096
"""Finished futures kept for ``retrieve_future`` (a retry may ask again); the oldest go first."""
LINGER_S = 0.02
MAX_LINGER_S = 0.25
"""How long a sampling batch waits for more calls of its kind: ``LINGER_S`` after the last
one came, and no longer than ``MAX_LINGER_S`` after the first was queued."""

@dataclasses.dataclass
class _Future:
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  json: dict | None = None
  proto: bytes | None = None
  error: str | None = None
  category: str = "user"
  seconds: float = 0.0
  """How long the worker took (queueing excluded)."""


@dataclasses.dataclass
class _Job:
  future: _Future
  run: Callable[[], dict | bytes] | None = None
  batch: Hashable | None = None
  """Jobs with the same ``batch`` key run together: ``run_batch`` given all their ``payload``s
  returns one result each."""
  payload: object = None
  run_batch: Callable[[list], list] | None = None
  queued: float = dataclasses.field(default_factory=time.monotonic)

  @property
  def lane(self) -> str:
    return "sample" if self.run_batch is not None else "train"


class WorkQueue:
  """The calls of a service, run in order by one worker thread, or by one per lane when
  ``split`` (see the module docstring)."""

  def __init__(self, split: bool = False):
    self.futures: dict[str, _Future] = {}
    self._work: collections.deque[_Job] = collections.deque()
    self._queued = threading.Condition()
    self._ids = itertools.count()
    self._workers = [threading.Thread(target=self._run, args=(lane,), daemon=True,
                                      name=f"rlx-tinker-{lane or 'worker'}")
                     for lane in (("train", "sample") if split else (None,))]
    for worker in self._workers:
      worker.start()

  def submit(self, fn: Callable[[], dict | bytes] | None, model_id: str | None = None,
             samples: int = 0, **batch) -> dict:
    """Queues ``fn`` (or, with ``batch=KEY, payload=..., run_batch=...``, a job that runs with
    the other queued jobs of the same key); returns its future (with one sequence id per
    sample, for a sampling call)."""
    request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
    future = self.futures[request_id] = _Future()
    with self._queued:
      self._work.append(_Job(future, fn, **batch))
      self._queued.notify_all()  # split: the worker of the job's lane may be either
    answer = {"request_id": request_id, **({"model_id": model_id} if model_id else {})}
    if samples:
      answer["sample_sequence_ids"] = [f"{request_id}:{i}" for i in range(samples)]
    return answer

  def _next(self, lane: str | None) -> list[_Job]:
    """The next job of ``lane`` (None: of any), with every queued job of its batch key (taken
    out of the queue; the others keep their order). A batch waits while more of its jobs keep
    arriving (``LINGER_S`` each, ``MAX_LINGER_S`` in all): a client that sends a group's calls
    one by one sends them milliseconds apart, and the first should not decode alone."""
    with self._queued:
      while (job := next((j for j in self._work if lane in (None, j.lane)), None)) is None:
        self._queued.wait()
      self._work.remove(job)
      if job.batch is None:
        return [job]
      jobs, last = [job], time.monotonic()
      while True:
        together = [j for j in self._work if j.batch == job.batch]
        for j in together:
          self._work.remove(j)
        jobs += together
        now = time.monotonic()
        last = now if together else last
        if now - last >= LINGER_S or now - jobs[0].queued >= MAX_LINGER_S:
          return jobs
        self._queued.wait(LINGER_S - (now - last))

  def _run(self, lane: str | None) -> None:
    while True:
      jobs = self._next(lane)
      started = time.perf_counter()
      try:
        if jobs[0].run_batch is None:
          results = [jobs[0].run()]
        else:
          results = jobs[0].run_batch([j.payload for j in jobs])
        for job, result in zip(jobs, results, strict=True):
          if isinstance(result, bytes):
            job.future.proto = result
          else:
            job.future.json = result
      except (BadInput, wire.WireError, ValueError, KeyError) as error:
        for job in jobs:
          job.future.error = str(error) if not isinstance(error, KeyError) else f"unknown {error}"
      except Exception as error:  # noqa: BLE001 - reported to the caller, the service goes on
        for job in jobs:
          job.future.error, job.future.category = f"{type(error).__name__}: {error}", "server"
        log.error("tinker: a call failed:\n%s", traceback.format_exc())
      for job in jobs:
        job.future.seconds = time.perf_counter() - started
        job.future.done.set()
      self._forget_old()

  def _forget_old(self) -> None:
    """Drops the oldest finished futures past ``KEPT_FUTURES`` (a long session's results
    would otherwise pile up: every forward_backward's outputs)."""
    excess = len(self.futures) - KEPT_FUTURES
    if excess > 0:
      for request_id in [r for r, f in list(self.futures.items()) if f.done.is_set()][:excess]:
        self.futures.pop(request_id, None)

  def cancel(self, request_id: str) -> bool:
    """Drops a queued sampling call its client abandoned (``cancel_future``); its future ends
    with the reason. One already decoding finishes, unread. Returns whether it was dropped."""
    future = self.futures.get(request_id)
    with self._queued:
      job = next((j for j in self._work if j.future is future and j.batch is not None), None)
      if job is None:
        return False
      self._work.remove(job)
    job.future.error = "cancelled by the client"
    job.future.done.set()
    return True

  def retrieve(self, request_id: str, wait_s: float = POLL_S):
    """The future's result: a dict, protobuf bytes, or ``{"type": "try_again"}``."""
    future = self.futures.get(request_id)
    if future is None:
      raise BadInput(f"request_id {request_id!r} was never issued by this service")
    if not future.done.wait(wait_s):
      return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    if future.error is not None:
      return {"error": future.error, "category": future.category}
    return future.proto if future.proto is not None else future.json
