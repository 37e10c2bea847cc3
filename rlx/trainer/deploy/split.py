"""Split in one process: generation and learning on disjoint sub-meshes, at the same time.

    summary = train_split(config, workdir)

A generator thread runs the producer loop (``rlx.trainer.produce.loop``): it samples and scores
batches on the generation sub-mesh and hands them to the learner through a bounded queue (``ThreadSource``, the batch source of the one learner
loop, ``rlx.trainer.learn.loop``); the learner trains on the learning sub-mesh and publishes every
new policy version (reshard across sub-meshes, or an Orbax checkpoint). Staleness is bounded
by ``mesh.max_staleness`` = k:

- the generator starts the batch the learner will train on at policy version v only once
  version v - k is published (it blocks when k versions ahead: ``control.may_start``), and
  samples with the newest version it has; with ``mesh.inflight_updates`` a version published
  while it samples reaches the sequences in flight between decode chunks, each token keeping
  the version that sampled it. So with k = 0 the two take turns (synchronous), with k >= 1
  they overlap, and a batch's oldest token is at most k versions old;
- the learner's controller (``rlx.trainer.control``) drops a batch holding a rollout more
  than k versions behind (the gate above makes that impossible unless it is bypassed; the
  check is the guarantee), expires batches past ``mesh.lag_threshold`` or ``data.max_age_s``,
  lowers the effective k while the lag or the importance weights' clip fraction stay too
  high, and raises the sampling temperature or the clip-high while entropy is under
  ``algorithm.entropy_floor``;
- the loss corrects what staleness remains with the configured off-policy weights
  (``algorithm.off_policy``: truncated importance sampling of the recomputed old log-probs
  against the behaviour log-probs of the engine).

This deployment adds to the loop's metrics the busy fraction of each side (cumulative since
the loop started, and over the last 10 steps), the generator's sync and wait seconds and
the generation tokens/s.
"""

from __future__ import annotations

import pathlib
import queue
import threading
import time

from rlx.config import ConfigError, RunConfig
from rlx.metrics import BusyWindow
from rlx.trainer import control
from rlx.trainer.produce.collect import collect
from rlx.trainer.common import Say
from rlx.trainer.learn.experience import make_mismatch
from rlx.trainer.setup.run import Run
from rlx.trainer.produce.evaluate import evaluate
from rlx.trainer.learn.loop import Batch, BatchSource, Summary, learn_run
from rlx.trainer.produce.loop import Opened, Produced, Weights, produce
from rlx.trainer.produce.stream import stream_produce


class ThreadGate:
  """The gate of the generator thread: the learner reports every batch it is done with
  (``finish``), and batch i starts once ``control.may_start(i, finished, k)``."""

  def __init__(self, k: int, finished: int = 0):
    self.k, self.finished = k, finished
    self.setting = 0
    """Changes of k taken so far (a batch started before the last one is not evidence about
    the current k)."""
    self.temperature: float | None = None
    """The sampling temperature, when a controller overrides rollout.temperature."""
    self._progress = threading.Condition()
    self._halted = False

  def wait(self, index: int, timeout: float | None = None) -> Opened | None | bool:
    """Blocks until batch ``index`` may start (None: stop); with ``timeout``, False once
    that many seconds passed without it opening (0: only look)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._progress:
      while not control.may_start(index, self.finished, self.k) and not self._halted:
        left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
        if left <= 0:
          return False
        self._progress.wait(timeout=left)
      return None if self._halted else Opened(self.setting, self.temperature)

  def finish(self) -> None:
    """The learner is done with one more batch (trained and published, or dropped)."""
    with self._progress:
      self.finished += 1
      self._progress.notify_all()

  def retune(self, k: int, temperature: float | None) -> None:
    """From now on, start a batch only while the learner is at most ``k`` versions behind."""
    with self._progress:
      if k != self.k:
        self.k, self.setting = k, self.setting + 1
      self.temperature = temperature
      self._progress.notify_all()

  @property
  def halted(self) -> bool:
    return self._halted

  def halt(self) -> None:
    with self._progress:
      self._halted = True
      self._progress.notify_all()


class Generator(threading.Thread):
  """Runs the producer loop (``rlx.trainer.produce.loop``) on the generation sub-mesh, handing
  batches to the learner through a bounded queue, at most ``max_staleness`` policy versions
  ahead of it (``ThreadGate``)."""

  def __init__(self, run: Run, *, first_step: int, delay_s: float = 0.0, mismatch=None,
               mismatch_every: int = 0, collect_fn=collect):
    super().__init__(name="rlx-generator", daemon=True)
    self.job, self.first_step, self.delay_s = run, first_step, delay_s
    self.collect_fn = collect_fn
    self.gate = ThreadGate(control.bound(run.config), finished=first_step)
    self.weights = Weights(run.sync.latest)
    self.queue: queue.Queue[Produced | BaseException] = queue.Queue(
        maxsize=control.bound(run.config) + 1)
    self._mismatch, self.mismatch_every = mismatch, mismatch_every
    """``experience.make_mismatch``'s measure, run on every ``mismatch_every``-th batch."""
    self.busy_seconds = 0.0
    self.tokens = 0

  def run(self) -> None:
    try:
      if self.job.config.mesh.admission == "continuous":
        stream_produce(self.job, self.gate, self.weights, self, first=self.first_step,
                       mismatch=self._mismatch, mismatch_every=self.mismatch_every)
      else:
        produce(self.job, self.gate, self.weights, self, first=self.first_step,
                mismatch=self._mismatch, mismatch_every=self.mismatch_every,
                delay_s=self.delay_s, collect_fn=self.collect_fn)
    except BaseException as error:  # noqa: BLE001 - handed to the learner, which raises it
      self._hand_over(error)

  def put(self, produced: Produced) -> None:
    """The producer's sink: the hand-over queue."""
    self.busy_seconds += produced.busy_seconds
    self.tokens += sum(c.sampled_tokens for c in produced.draw.completions)
    self._hand_over(produced)

  def stop(self) -> None:
    self.gate.halt()

  def _hand_over(self, item) -> None:
    """Puts ``item`` in the queue, waiting for room unless the generator is stopped."""
    while not self.gate.halted:
      try:
        self.queue.put(item, timeout=0.5)
        return
      except queue.Full:
        continue

  def next(self, timeout: float | None = None) -> Produced:
    """The next batch; raises what the generator raised, ``queue.Empty`` after ``timeout``."""
    item = self.queue.get(timeout=timeout)
    if isinstance(item, BaseException):
      raise item
    return item


class ThreadSource(BatchSource):
  """The batch source of split in one process: the generator thread's hand-over queue."""

  def __init__(self, generator: Generator):
    self.generator = generator
    self.started = time.perf_counter()
    self.learn_seconds = 0.0
    self.busy = BusyWindow(window=10)

  def next(self, version: int, wait: bool = True) -> Batch | None:
    try:  # waits at most half a second: the loop checks for a stop signal twice a second
      produced = self.generator.next(timeout=0.5 if wait else 0.0)
    except queue.Empty:
      return None
    return Batch(produced.draw, produced.draw.data_state,
                 current=produced.setting == self.generator.gate.setting,
                 metrics={"time/generator_sync_s": produced.sync_seconds,
                          "time/generator_wait_s": produced.waited_seconds,
                          "rollout/weight_updates_in_flight": produced.weight_swaps})

  def settle(self, batch: Batch, verdict: str, version: int) -> None:
    self.generator.gate.finish()

  def retune(self, controller: control.Controller) -> None:
    self.generator.gate.retune(controller.k, controller.temperature)

  def metrics(self, learn_seconds: float) -> dict:
    self.learn_seconds += learn_seconds
    generator = self.generator
    wall = time.perf_counter() - self.started
    return {"time/generation_busy_frac": min(generator.busy_seconds / wall, 1.0),
            "time/learning_busy_frac": min(self.learn_seconds / wall, 1.0),
            **self.busy.update(wall, {"time/generation_busy_frac_window": generator.busy_seconds,
                                      "time/learning_busy_frac_window": self.learn_seconds}),
            "throughput/generation_tokens_per_s": generator.tokens / max(generator.busy_seconds,
                                                                         1e-9)}

  def close(self) -> None:
    self.generator.stop()
    self.generator.join(timeout=30)


def train_split(config: RunConfig, workdir: str | pathlib.Path, say: Say = print, *,
                learner_delay_s: float = 0.0, generator_delay_s: float = 0.0) -> Summary:
  """Runs (or resumes) a split run in one process; returns its summary.

  ``learner_delay_s`` / ``generator_delay_s`` slow one side down on purpose (for tests
  and benchmarks of the staleness control).
  """
  if config.mesh.mode != "split":
    raise ConfigError("train_split needs config.mesh.mode=split")
  if config.mesh.multihost:
    raise ConfigError(
        "config.mesh.mode=split runs generation in a thread of one controller and does not "
        "span processes yet (config.mesh.multihost=true)")
  every = config.logging.mismatch_every

  def make_source(run, learner, start, controller) -> ThreadSource:
    generator = Generator(run, first_step=start or 0, delay_s=generator_delay_s,
                          mismatch_every=every, mismatch=make_mismatch(
                              config, run.model.transformer, run.tokenizer.pad_id)
                          if every else None)
    source = ThreadSource(generator)
    source.retune(controller)
    generator.start()
    return source

  return learn_run(config, workdir, say, evaluate, make_source, learner_delay_s=learner_delay_s)
