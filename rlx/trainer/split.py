"""The split loop: generation and learning on disjoint sub-meshes, at the same time.

    summary = train_split(config, workdir)

A generator thread samples and scores batches on the generation sub-mesh and
hands them to the learner through a bounded queue; the learner trains on the
learning sub-mesh and publishes every new policy version (reshard across
sub-meshes, or an Orbax checkpoint). Staleness is bounded by
``mesh.max_staleness`` = k:

- the generator starts the batch the learner will train on at policy version v
  only once version v - k is published (it blocks when k versions ahead), and
  samples with the newest version it has; so with k = 0 the two take turns
  (synchronous), with k >= 1 they overlap;
- the learner checks every batch: one holding a rollout more than k versions
  behind is dropped and counted (it cannot happen with the gate above, unless
  the gate is bypassed; the check is the guarantee);
- the loss corrects what staleness remains with the configured off-policy
  weights (``algorithm.off_policy``: truncated importance sampling of the
  recomputed old log-probs against the behaviour log-probs of the engine).

A controller (``rlx.trainer.control``) closes the loop when configured: it expires batches
past ``mesh.lag_threshold`` versions or ``data.max_age_s`` seconds, lowers the effective k
while the lag or the importance weights' clip fraction stay too high (and raises it again
when healthy), and raises the sampling temperature or the clip-high while entropy is under
``algorithm.entropy_floor``; every change is said and logged as a ``control/*`` metric.

Metrics add the policy lag (mean, max), dropped and expired batches, the busy fraction of
each side (cumulative since the loop started, and over the last 10 steps), the sync
seconds of each side and the tokens/s of each side.
"""

from __future__ import annotations

import dataclasses
import pathlib
import queue
import threading
import time

import jax
import numpy as np

from rlx.checkpoint import StopSignal
from rlx.config import ConfigError, RunConfig
from rlx.metrics import BusyWindow, MetricsSink, ProfileWindow
from rlx.trainer.common import (Draw, Run, Say, collect, device_memory, evaluate,
                                 evaluation_due)
from rlx.trainer import control
from rlx.trainer.buffer import ReplayBuffer
from rlx.trainer.learner import begin, finish


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

  def __init__(self, run: Run, *, like, first_step: int, versions_per_step: int,
               delay_s: float = 0.0, collect_fn=collect):
    super().__init__(name="rlx-generator", daemon=True)
    self.job, self.like, self.delay_s, self.collect_fn = run, like, delay_s, collect_fn
    self.versions_per_step = versions_per_step
    self.ahead = run.config.mesh.max_staleness // versions_per_step
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
    newer = self.job.sync.latest(self._version, like=self.like)
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
        self.busy_seconds += time.perf_counter() - started
        self.tokens += sum(len(c.response_tokens) for c in draw.completions)
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
  """Whether ``draw`` holds a rollout more than ``max_staleness`` versions behind ``version``."""
  return any(version - c.policy_version > max_staleness for c in draw.completions)


def lag(draw: Draw, version: int) -> tuple[float, int]:
  """(mean, max) policy lag of ``draw``'s rollouts, were the learner to train on them at
  ``version``."""
  versions = np.array([c.policy_version for c in draw.completions])
  return float(np.mean(version - versions)), int(np.max(version - versions))


def apply(events: list[control.Event], controller: control.Controller, say: Say,
          generator: Generator | None = None) -> None:
  """Announces a controller's changes and hands the new knobs to the generator thread."""
  for event in events:
    say(f"rlx: control: {event}")
  if events and generator is not None:
    generator.set_staleness(controller.k)
    generator.temperature = controller.temperature


def train_split(config: RunConfig, workdir: str | pathlib.Path, say: Say = print, *,
                learner_delay_s: float = 0.0, generator_delay_s: float = 0.0) -> dict:
  """Runs (or resumes) a split run; returns a summary with the eval accuracy before and after.

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
  try:
    return _loop(config, run, learner, start, accuracy_before, say, learner_delay_s,
                 generator_delay_s)
  finally:
    run.close()


def _loop(config, run, learner, start, accuracy_before, say, learner_delay_s,
          generator_delay_s) -> dict:
  step = start or 0
  generator = Generator(run, like=learner.abstract_params, first_step=step,
                        versions_per_step=1, delay_s=generator_delay_s)
  k = config.mesh.max_staleness
  controller = control.Controller.from_config(config)
  controller.restore(learner.restored_meta.get("control"))
  generator.set_staleness(controller.k)
  generator.temperature = controller.temperature
  expired_batches = 0
  buffer = ReplayBuffer.from_config(config) if config.buffer.enabled else None
  if buffer is not None:
    buffer.restore(learner.restored_meta.get("buffer"))
  starved = True  # the buffer could not make a batch: wait for the generator
  sink = MetricsSink(run.workdir, config.logging, total_steps=config.trainer.steps,
                     resume_step=start, write=jax.process_index() == 0)
  dropped_batches, learn_seconds, learn_tokens = 0, 0.0, 0
  busy = BusyWindow(window=10)
  data_state = run.stream.get_state()
  generator.start()
  loop_started = time.perf_counter()
  with StopSignal(say=say) as stop, sink, ProfileWindow(
      config.logging, run.workdir / "profile", jax.process_index(), say) as profile:
    try:
      while step < config.trainer.steps and not stop.requested:
        profile.at(step)
        started = time.perf_counter()
        try:  # with a buffer that can make a batch, only take what has already arrived
          produced = generator.next(timeout=0.5 if buffer is None or starved else 0.0)
        except queue.Empty:  # checks for a stop signal twice a second
          produced = None
          if buffer is None:
            continue
        except StopIteration:  # a finite data.num_epochs is used up
          say(f"rlx: the data ran out after {config.data.num_epochs} epoch(s), at step {step}")
          break
        received = time.perf_counter()
        if buffer is not None:
          if produced is not None:
            buffer.put(produced.draw)
            generator.finished()
            data_state = produced.draw.data_state  # the buffer's groups are saved with it
          draw = buffer.take(learner.version, time.time())
          starved = draw is None
          if draw is None:
            continue
        else:
          draw = produced.draw
        lag_mean, lag_max = lag(draw, learner.version)
        # only batches started under the current k tell the controller about it
        current = produced is None or produced.setting == generator.setting
        if expired(draw, learner.version, k):
          dropped_batches += 1
          generator.finished()
          continue
        if controller.expired(lag_max, time.time() - draw.born):
          expired_batches += 1
          generator.finished()
          if current:
            apply(controller.observe(step, lag_mean=lag_mean), controller, say, generator)
          continue
        learner.clip_eps_high = controller.clip_eps_high
        metrics = learner.learn(draw)
        if learner_delay_s:
          time.sleep(learner_delay_s)
        learned = time.perf_counter()
        sync_seconds = learner.publish()
        if buffer is None:
          generator.finished()
          data_state = draw.data_state
        finished = time.perf_counter()
        step += 1
        learn_seconds += finished - received
        tokens = sum(len(c.response_tokens) for c in draw.completions)
        learn_tokens += tokens
        wall = finished - loop_started
        elapsed = finished - started
        apply(controller.observe(step, lag_mean=lag_mean if current else None,
                                 is_clip_frac=metrics["policy/is_clip_frac"],
                                 entropy=metrics["policy/entropy"]), controller, say, generator)
        metrics.update(controller.metrics())
        if controller.expires:
          metrics["rollout/expired_batches"] = expired_batches
        if buffer is not None:
          metrics.update(buffer.metrics(time.time()))
        metrics.update({
            "rollout/dropped_batches": dropped_batches,
            "time/step_s": elapsed, "time/wait_for_data_s": received - started,
            "time/learn_s": learned - received, "time/sync_s": sync_seconds,
            # of the batch that arrived this step (none may have, with a buffer)
            "time/generate_s": produced.draw.generate_seconds if produced else 0.0,
            "time/generator_sync_s": produced.sync_seconds if produced else 0.0,
            "time/generator_wait_s": produced.waited_seconds if produced else 0.0,
            "time/generation_busy_frac": min(generator.busy_seconds / wall, 1.0),
            "time/learning_busy_frac": min(learn_seconds / wall, 1.0),
            **busy.update(wall, {"time/generation_busy_frac_window": generator.busy_seconds,
                                 "time/learning_busy_frac_window": learn_seconds}),
            **device_memory(),
            "throughput/tokens_per_s": tokens / elapsed,
            "throughput/samples_per_s": len(draw.completions) / elapsed,
            "throughput/generation_tokens_per_s": generator.tokens / max(generator.busy_seconds,
                                                                         1e-9),
            "throughput/learning_tokens_per_s": learn_tokens / max(learn_seconds, 1e-9)})
        if evaluation_due(config, step, stop.requested):
          metrics.update(evaluate(run, learner.generation_params()))
        sink.write(step, metrics)
        if learner.checkpoint_due(step, stop.requested):
          learner.save(step, data_state, control=controller.state(),
                       buffer=None if buffer is None else buffer.state())
        learner.export_due(step)
    finally:
      generator.stop()
      generator.join(timeout=30)
    summary = finish(run, learner, start=start, step=step, stop=stop, data_state=data_state,
                     accuracy_before=accuracy_before, metrics_path=sink.jsonl_path, say=say,
                     save_meta={"control": controller.state(),
                                "buffer": None if buffer is None else buffer.state()})
  return dict(summary, dropped_batches=dropped_batches, expired_batches=expired_batches,
              control_events=[str(event) for event in controller.events])
