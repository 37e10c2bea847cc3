"""A split run as two jobs: a learner job and a generator job (``mesh.role``), each its own
process (or ``jax.distributed`` cluster), sharing only the workdir.

    python -m rlx.main --config configs/dapo_split.py --workdir W --config.mesh.role=learner \\
        --config.mesh.weight_sync=delta &
    python -m rlx.main --config configs/dapo_split.py --workdir W --config.mesh.role=generator \\
        --config.mesh.weight_sync=delta

(``launch/local.sh --learner 1 --generator 1 ...`` starts both.) Weights go as policy
versions in ``W/policy_versions`` (``rlx.versions``' whole and delta files, or Orbax
checkpoints with ``weight_sync=orbax``; the newest k + 3 kept); rollouts as files in
``W/rollouts`` (``rlx.trainer.deploy.exchange``). Staleness is bounded by ``mesh.max_staleness``
= k exactly as in one process: the generator starts batch i once the learner has
finished (trained or dropped) batch i - k - 1, sampling with the newest version
published; the learner drops a batch holding a rollout more than k versions old. So at
most k + 1 batches wait unfinished: that is the back-pressure.

Resuming: the learner's checkpoint records the next rollout index; files below it are
deleted (counted as ``rollout/expired_files``). A restarted generator continues after its
newest complete file (or after the learner's last finished batch), from that file's data
position, so no batch is generated twice or lost. The learner writes ``rollouts/DONE``
when it stops for good; the generator exits when it sees it.

Several generator jobs (``mesh.generators`` = n, each with its ``mesh.generator_id``;
``launch/local.sh --generator n``) feed one learner: job g writes batches g, g + n, ...
from its own share of the prompts (every n-th row of the source), and the learner takes
them in order. The staleness gate is the same, so at most k + 1 batches are in flight
over all of them: more generator jobs than k + 1 wait on the gate.

The learner job runs the one learner loop (``rlx.trainer.learn.loop``) over a ``FileSource``;
its controller (``rlx.trainer.control``) runs as in one process: it expires batches past
the lag or age limit, and hands its effective k and sampling temperature to the generator
job through ``rollouts/control.json``.

Jobs fail loudly: each writes ``WORKDIR/jobs/<role>-<id>.json`` (``rlx.trainer.deploy.jobstatus``:
running with a heartbeat, then finished, stopped or failed with its error). The learner
stops with an error naming the generator job it waits on once that job failed, died, or
was silent past ``mesh.job_timeout_s``; a generator does the same for its learner.

This deployment adds to the loop's metrics ``rollout/index`` (the file trained on),
``rollout/generator`` (which job wrote it, with several), ``data/prompts_drawn``,
``rollout/expired_files`` and ``time/generator_sync_s``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax

from rlx import cli, distributed, progress
from rlx.checkpoint import StopSignal
from rlx.config import RunConfig
from rlx.data import prompts_drawn
from rlx.trainer import control
from rlx.trainer.deploy import jobstatus
from rlx.trainer.draw import Draw
from rlx.trainer.learn.experience import make_mismatch
from rlx.trainer.common import Say, TrainingError
from rlx.trainer.setup.run import Run, prepare
from rlx.trainer.deploy.exchange import RolloutFiles
from rlx.trainer.produce.evaluate import evaluate
from rlx.trainer.learn.loop import Batch, BatchSource, Summary, learn_run
from rlx.trainer.produce.loop import Opened, Produced, Weights, produce
from rlx.trainer.produce.stream import stream_produce

POLL_S = 0.1
INFLIGHT_POLL_S = 0.5
"""How often a generator job looks for a newer policy version while it samples (in the
background, but listing the versions on shared storage costs tens of milliseconds of CPU)."""
NOTICE_S = 60.0
WATCH_S = 1.0
"""How often a waiting job reads the status files of the job it waits on."""


class PeerWatch:
  """Raises ``TrainingError`` on every process of a job once the job it waits on will never
  deliver (process 0 reads the status files; every process follows its answer)."""

  def __init__(self, workdir: pathlib.Path, role: str, jobs: int, timeout_s: float):
    self.workdir, self.role, self.jobs, self.timeout_s = workdir, role, jobs, timeout_s
    self.since = time.time()
    self._checked = 0.0

  def check(self, job: int) -> None:
    """Raises when job ``job`` of the watched role failed, died or went silent."""
    if time.monotonic() - self._checked < WATCH_S:
      return
    self._checked = time.monotonic()
    problem = None
    if distributed.lead():
      name = (f"{self.role} job" if self.jobs == 1 else f"{self.role} job {job}")
      status = jobstatus.read_status(self.workdir, self.role, job)
      problem = jobstatus.silent_or_failed(f"the {name}", status, now=time.time(),
                                           since=self.since, timeout_s=self.timeout_s)
    problem = distributed.agree(problem or "")
    if problem:
      raise TrainingError(problem)


class FileSource(BatchSource):
  """The batch source of the learner job: rollout files, in order, from the generator jobs."""

  def __init__(self, run: Run, restored_meta: dict, version: int, say: Say):
    config = run.config
    self.files = RolloutFiles(run.workdir / "rollouts", config.mesh.generators)
    self.say = say
    self.index = distributed.agree(max(int(restored_meta.get("rollout_index", 0)),
                                       self.files.progress()["done"]))
    self.expired_files = 0
    if distributed.lead():
      self.files.clear_done()
      self.files.restart_at(version)
      self.expired_files = self.files.expire_below(self.index)
    if self.expired_files:
      say(f"rlx: learner: deleted {self.expired_files} rollout file(s) consumed before the "
          "restart")
    self.setting = int(restored_meta.get("control_setting", 0))
    """How many changes of k the learner has made: a batch started under an earlier one says
    nothing about the current k."""
    self._k = None
    self.watch = PeerWatch(run.workdir, "generator", config.mesh.generators,
                           config.mesh.job_timeout_s)
    self._noticed = time.perf_counter()

  def next(self, version: int, wait: bool = True) -> Batch | None:
    files, index = self.files, self.index
    # process 0 looks for the file, and every process of the job follows its answer
    if not distributed.agree(files.path(index).is_file()):
      progress.waiting("the generator job" if files.generators == 1
                       else f"generator job {index % files.generators}")
      self.watch.check(index % files.generators)
      if time.perf_counter() - self._noticed > NOTICE_S:
        source = ("the generator job" if files.generators == 1
                  else f"generator job {index % files.generators}")
        self.say(f"rlx: learner: waiting for rollout file {files.path(index)} from {source}")
        self._noticed = time.perf_counter()
      if wait:
        time.sleep(POLL_S)
      return None
    self._noticed = time.perf_counter()
    progress.doing(f"training on rollout {index}")
    draw, extra = _read(files, index)
    metrics = {"rollout/index": index, "rollout/expired_files": self.expired_files,
               # prompts the generator had drawn after this batch: its consecutive batches
               # never repeat or skip prompts, across restarts too
               "data/prompts_drawn": prompts_drawn(draw.data_state),
               "time/generator_sync_s": extra["generator_sync_s"],
               "rollout/weight_updates_in_flight": extra.get("weight_updates_in_flight", 0)}
    if files.generators > 1:
      metrics["rollout/generator"] = index % files.generators  # which job wrote it
    return Batch(_local_share(draw), draw.data_state,
                 current=extra.get("setting", 0) == self.setting, metrics=metrics,
                 # the whole batch's versions: the same lag on every process
                 policy_versions=[c.policy_version for c in draw.completions])

  def settle(self, batch: Batch, verdict: str, version: int) -> None:
    if distributed.lead():  # after a trained batch's publish: the generator's gate opens
      self.files.finish(self.index, batch.data_state, version)
    self.index += 1

  def retune(self, controller: control.Controller) -> None:
    if self._k is not None and controller.k != self._k:
      self.setting += 1
    self._k = controller.k
    if distributed.lead():
      self.files.write_control({"k": controller.k, "temperature": controller.temperature,
                                "setting": self.setting})

  def state(self) -> dict:
    return {"rollout_index": self.index, "control_setting": self.setting}


def train_learner(config: RunConfig, workdir: str | pathlib.Path, say: Say = print) -> Summary:
  """The learner job: trains on rollout files as they come, publishes every version."""
  sources: list[FileSource] = []

  def make_source(run, learner, start, controller) -> FileSource:
    files = FileSource(run, learner.restored_meta, learner.version, say)
    files.retune(controller)  # the generator jobs follow the restored knobs
    sources.append(files)
    return files

  summary = learn_run(config, workdir, say, evaluate, make_source)
  files = sources[0]
  if not summary.stopped and distributed.lead():
    files.files.mark_done()  # the generator job exits; a stopped learner's generator waits
  return summary


@dataclasses.dataclass(frozen=True)
class GeneratorSummary:
  """How a generator job ended."""

  written: int
  """Rollout files it wrote."""
  next_index: int
  stopped: bool
  """Stopped by a signal (rerunning resumes) rather than told the learner is done."""


def train_generator(config: RunConfig, workdir: str | pathlib.Path,
                    say: Say = print) -> GeneratorSummary:
  """The generator job: samples and scores batches with the newest published policy and
  writes them as rollout files, within the staleness bound; returns a summary."""
  run = prepare(config, workdir, say)
  jobs, me = config.mesh.generators, config.mesh.generator_id
  name = "generator" if jobs == 1 else f"generator {me}"
  files = RolloutFiles(run.workdir / "rollouts", jobs)
  if files.remove_partial(me):
    say(f"rlx: {name}: removed a rollout file a killed writer left half-written")
  pending = [i for i in files.pending() if files.mine(i, me)]
  done = files.progress()["done"]
  if pending:  # after its newest complete file, from that file's data position
    index, data_state = pending[-1] + jobs, files.read(pending[-1])[0].data_state
  else:  # its first batch the learner has not finished
    index, data_state = done + (me - done) % jobs, files.resume_state(me)
  if data_state is not None:
    run.stream.set_state(data_state)
  if index >= jobs:
    say(f"rlx: {name}: resuming at rollout {index}")
  gate = FileGate(run, files, name, say)
  sink = FileSink(files, jobs)
  every = config.logging.mismatch_every
  mismatch = make_mismatch(config, run.model.transformer, run.tokenizer.pad_id) if every else None
  try:
    with StopSignal(say=say, grace_s=config.checkpoint.stop_grace_s,
                    pending=cli.take_stop_at_start()) as stop:
      gate.stop = stop
      try:
        producer = stream_produce if config.mesh.admission == "continuous" else produce
        index = producer(run, gate, gate.weights, sink, first=index, stride=jobs,
                         mismatch=mismatch, mismatch_every=every)
      except StopIteration:
        say(f"rlx: {name}: the data ran out after {config.data.num_epochs} epoch(s)")
        index = sink.next_index if sink.next_index is not None else index
  finally:
    gate.weights.close()
    run.close()
  say(f"rlx: {name}: wrote {sink.written} rollout file(s); the next is {index}")
  return GeneratorSummary(written=sink.written, next_index=index, stopped=stop.requested)


class FileGate:
  """The gate of a generator job: the learner's progress (finished batches, its policy
  version) and the controller's knobs, as the rollout directory shows them to process 0
  and every process agrees. It opens for batch i once ``control.may_start`` and this job
  holds weights at least as new as the learner's; it says stop when the learner is done or a
  stop signal came, and raises once the learner job failed or went silent."""

  def __init__(self, run: Run, files: RolloutFiles, name: str, say: Say):
    config = run.config
    self.run, self.files, self.name, self.say = run, files, name, say
    self.stop = None  # the job's StopSignal, set once it is installed
    # between batches only where several processes sample: each reads storage itself, and a
    # swap one of them saw earlier than the others would split their programs
    inflight = config.mesh.inflight_updates and jax.process_count() == 1
    self.weights = Weights(lambda version: _latest(run, version),
                           poll_s=INFLIGHT_POLL_S if inflight else float("inf"),
                           background=inflight)
    self.learner = PeerWatch(run.workdir, "learner", 1, config.mesh.job_timeout_s)
    self._noticed = time.perf_counter()

  def wait(self, index: int, timeout: float | None = None) -> Opened | None | bool:
    config, files, weights = self.run.config, self.files, self.weights
    deadline = None if timeout is None else time.perf_counter() + timeout
    while not files.done() and not (self.stop is not None and self.stop.requested):
      shown = files.progress()
      seen = json.loads(distributed.agree(json.dumps(
          {"done": shown["done"], "version": shown.get("version", -1),
           "control": files.control() or {}})))
      knobs = seen["control"]
      opened = control.may_start(index, seen["done"], knobs.get("k", control.bound(config)))
      # Storage is read only when the learner shows a version this job lacks, or one older
      # than it holds: a stream asks the gate before every decode chunk, and listing the
      # versions costs tens of milliseconds.
      if opened and (weights.params is None or weights.version < seen["version"]):
        if weights.background and timeout == 0.0:
          # a stream's look between decode chunks: the read goes on in the background while
          # the chunks decode, and the gate opens once it has landed
          weights.ask()
        else:  # what a background read brought, else a read here
          weights.refresh()
          if weights.params is None or weights.version < seen["version"]:
            weights.refresh(force=True)
      elif (opened and weights.version > seen["version"]
            and max(self.run.sync.versions(), default=-1) < weights.version):
        # nothing newer because the learner resumed from an earlier checkpoint: take its
        weights.go_back(_latest(self.run, -1))
      # open, with weights the learner has reached (shared storage may not show them yet)
      if opened and weights.params is not None and weights.version >= seen["version"]:
        self._noticed = time.perf_counter()
        return Opened(knobs.get("setting", 0), knobs.get("temperature"))
      if deadline is not None and time.perf_counter() >= deadline:
        return False
      progress.waiting("the learner job")
      self.learner.check(0)
      if time.perf_counter() - self._noticed > NOTICE_S:
        self.say(f"rlx: {self.name}: waiting for the learner job (rollout {index}, policy "
                 f"version {weights.version})")
        self._noticed = time.perf_counter()
      time.sleep(POLL_S)
    return None


class FileSink:
  """The sink of a generator job: one rollout file per batch."""

  def __init__(self, files: RolloutFiles, stride: int):
    self.files, self.stride = files, stride
    self.written = 0
    self.next_index: int | None = None

  def put(self, produced: Produced) -> None:
    self.files.write(produced.index, produced.draw, extra={
        "index": produced.index, "generator_sync_s": produced.sync_seconds,
        "setting": produced.setting, "weight_updates_in_flight": produced.weight_swaps})
    self.written += 1
    self.next_index = produced.index + self.stride


def _local_share(draw: Draw) -> Draw:
  """This process's contiguous share of a batch's rows (whole groups: ``prompts_per_step``
  splits over the processes); the whole batch in one process."""
  if jax.process_count() == 1:
    return draw
  rows, first = distributed.local_share(list(range(len(draw.completions))), "rollouts")
  part = slice(first, first + len(rows))
  return dataclasses.replace(draw, completions=draw.completions[part],
                             rewards=draw.rewards[part], correct=draw.correct[part])


def _read(files: RolloutFiles, index: int):
  """Rollout file ``index``, retried while shared storage has not shown it to this process."""
  for attempt in range(50):
    try:
      return files.read(index)
    except FileNotFoundError:
      if attempt == 49:
        raise
      time.sleep(POLL_S)


def _latest(run, version: int) -> tuple | None:
  """The newest policy version above ``version``, retrying when the learner deletes the one
  being read (it keeps k + 3)."""
  for attempt in range(20):
    try:
      return run.sync.latest(newer_than=version)
    except (FileNotFoundError, ValueError, OSError):
      if attempt == 19:
        raise
      time.sleep(POLL_S)
  return None
