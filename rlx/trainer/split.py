"""Split in one process: generation and learning on disjoint sub-meshes, at the same time.

    summary = train_split(config, workdir)

A generator thread samples and scores batches on the generation sub-mesh and hands them to
the learner through a bounded queue (``ThreadSource``, the batch source of the one learner
loop, ``rlx.trainer.loop``); the learner trains on the learning sub-mesh and publishes every
new policy version (reshard across sub-meshes, or an Orbax checkpoint). Staleness is bounded
by ``mesh.max_staleness`` = k:

- the generator starts the batch the learner will train on at policy version v only once
  version v - k is published (it blocks when k versions ahead), and samples with the newest
  version it has; so with k = 0 the two take turns (synchronous), with k >= 1 they overlap;
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

import dataclasses
import pathlib
import queue
import threading
import time

from rlx.config import ConfigError, RunConfig
from rlx.metrics import BusyWindow
from rlx.trainer import control
from rlx.trainer.buffer import buffered
from rlx.trainer.collect import Draw, collect
from rlx.trainer.common import Say
from rlx.trainer.experience import make_mismatch
from rlx.trainer.run import Run
from rlx.trainer.learner import begin
from rlx.trainer.loop import Batch, BatchSource, Summary, learn_loop


@dataclasses.dataclass
class _Produced:
  draw: Draw
  sync_seconds: float
  waited_seconds: float
  setting: int
  """How many staleness changes the generator had taken when it started this batch."""


class Generator(threading.Thread):
  """Produces scored batches on the generation sub-mesh, at most ``max_staleness`` policy
  versions ahead of the learner.

  The gate follows the learner's actual progress, not a schedule: the learner reports every
  batch it is done with (``finished``), trained or dropped. Batch i (counting from 0) is
  started once the learner is done with batch ``i - max_staleness // versions_per_step``;
  every batch between can raise the version by at most ``versions_per_step``, and the
  generator samples with the newest version published when it starts, so batch i is at most
  ``max_staleness`` versions old when the learner trains on it, whatever was dropped before it.
  """

  def __init__(self, run: Run, *, first_step: int, versions_per_step: int,
               delay_s: float = 0.0, collect_fn=collect, like=None, mismatch=None,
               mismatch_every: int = 0):
    del like  # the weight sync knows the params' structure; accepted for older callers
    super().__init__(name="rlx-generator", daemon=True)
    self.job, self.delay_s, self.collect_fn = run, delay_s, collect_fn
    self.versions_per_step = versions_per_step
    self.ahead = control.bound(run.config) // versions_per_step
    """Batches it may start before the learner is done (the controller may lower it)."""
    self.setting = 0
    """Staleness changes taken so far (a batch started before the last one is not evidence
    about the current k)."""
    self.temperature: float | None = None
    """The sampling temperature, when a controller overrides rollout.temperature."""
    self.first_step = first_step
    self.queue: queue.Queue[_Produced | BaseException] = queue.Queue(maxsize=self.ahead + 1)
    self._progress = threading.Condition()
    self._finished = 0  # batches the learner is done with
    self._halt = threading.Event()
    self.busy_seconds = 0.0
    self.tokens = 0
    self._params = None
    self._version = -1
    self._mismatch, self.mismatch_every = mismatch, mismatch_every
    """``experience.make_mismatch``'s measure, run on every ``mismatch_every``-th batch."""

  def finished(self) -> None:
    """The learner is done with one more batch (trained and published, or dropped)."""
    with self._progress:
      self._finished += 1
      self._progress.notify_all()

  def set_staleness(self, k: int) -> None:
    """From now on, start a batch only while the learner is at most ``k`` versions behind."""
    with self._progress:
      self.ahead = k // self.versions_per_step
      self.setting += 1
      self._progress.notify_all()

  def stop(self) -> None:
    self._halt.set()
    with self._progress:
      self._progress.notify_all()

  def _refresh(self) -> float:
    """Takes the newest published params, if newer than those held; returns the seconds."""
    started = time.perf_counter()
    newer = self.job.sync.latest(self._version)
    if newer is not None:
      self._params, self._version = newer
    return time.perf_counter() - started

  def run(self) -> None:
    try:
      index = 0
      while not self._halt.is_set():
        wait_started = time.perf_counter()
        with self._progress:
          while self._finished < index - self.ahead and not self._halt.is_set():
            self._progress.wait(timeout=0.5)
          setting = self.setting
        if self._halt.is_set():
          return
        waited = time.perf_counter() - wait_started
        sync_seconds = self._refresh()

        def params():
          nonlocal sync_seconds
          sync_seconds += self._refresh()
          return self._params, self._version

        started = time.perf_counter()
        draw = self.collect_fn(self.job, params, seed=self.job.config.trainer.seed * 1_000_003
                               + self.first_step + index, temperature=self.temperature)
        if self.delay_s:
          time.sleep(self.delay_s)
        if self._mismatch is not None and index % self.mismatch_every == 0:
          measured = self._mismatch(self._params, draw.completions, self._version,
                                    draw.temperature)
          if measured is not None:
            draw.counts["rollout/mismatch_kl"] = measured[0]
        self.busy_seconds += time.perf_counter() - started
        self.tokens += sum(c.sampled_tokens for c in draw.completions)
        self._hand_over(_Produced(draw, sync_seconds, waited, setting))
        index += 1
    except BaseException as error:  # noqa: BLE001 - handed to the learner, which raises it
      self._hand_over(error)

  def _hand_over(self, item) -> None:
    """Puts ``item`` in the queue, waiting for room unless the generator is stopped."""
    while not self._halt.is_set():
      try:
        self.queue.put(item, timeout=0.5)
        return
      except queue.Full:
        continue

  def next(self, timeout: float | None = None) -> _Produced:
    """The next batch; raises what the generator raised, ``queue.Empty`` after ``timeout``."""
    item = self.queue.get(timeout=timeout)
    if isinstance(item, BaseException):
      raise item
    return item


def expired(draw: Draw, version: int, max_staleness: int) -> bool:
  """Whether ``draw`` holds a rollout more than ``max_staleness`` versions behind ``version``
  (the controller's rule, ``control.past_bound``)."""
  _, lag_max = control.lag([c.policy_version for c in draw.completions], version)
  return control.past_bound(lag_max, max_staleness)


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
                 current=produced.setting == self.generator.setting,
                 metrics={"time/generator_sync_s": produced.sync_seconds,
                          "time/generator_wait_s": produced.waited_seconds})

  def settle(self, batch: Batch, verdict: str, version: int) -> None:
    self.generator.finished()

  def retune(self, controller: control.Controller) -> None:
    self.generator.set_staleness(controller.k)
    self.generator.temperature = controller.temperature

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
  run, learner, start, accuracy_before = begin(config, workdir, say)
  controller = control.Controller.from_config(config)
  controller.restore(learner.restored_meta.get("control"))
  every = config.logging.mismatch_every
  generator = Generator(run, first_step=start or 0, versions_per_step=1,
                        delay_s=generator_delay_s, mismatch_every=every, mismatch=make_mismatch(
                            config, run.model.transformer, run.tokenizer.pad_id) if every else None)
  source = ThreadSource(generator)
  source.retune(controller)
  source = buffered(source, config, controller, learner.restored_meta, run.stream.get_state())
  generator.start()
  return learn_loop(run, learner, source, controller, start=start,
                    accuracy_before=accuracy_before, say=say, learner_delay_s=learner_delay_s)
