"""A split run as two jobs: a learner job and a generator job (``mesh.role``), each its own
process (or ``jax.distributed`` cluster), sharing only the workdir.

    python -m rlx.main --config configs/dapo_split.py --workdir W --config.mesh.role=learner \\
        --config.mesh.weight_sync=orbax &
    python -m rlx.main --config configs/dapo_split.py --workdir W --config.mesh.role=generator \\
        --config.mesh.weight_sync=orbax

(``launch/local.sh --learner 1 --generator 1 ...`` starts both.) Weights go as Orbax
policy versions in ``W/policy_versions`` (the newest k + 2 kept); rollouts as files in
``W/rollouts`` (``rlx.trainer.exchange``). Staleness is bounded by ``mesh.max_staleness``
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

The learner's controller (``rlx.trainer.control``) runs as in one process: it expires
batches past the lag or age limit, and hands its effective k and sampling temperature to
the generator job through ``rollouts/control.json``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax

from rlx import distributed
from rlx.checkpoint import StopSignal
from rlx.config import RunConfig
from rlx.metrics import MetricsSink, ProfileWindow
from rlx.trainer.common import (Draw, Say, collect, device_memory, evaluate, evaluation_due,
                               prepare, throughput)
from rlx.trainer.control import Controller
from rlx.trainer.learner import begin, finish
from rlx.trainer.exchange import RolloutFiles
from rlx.trainer.split import apply, expired, lag

POLL_S = 0.1
NOTICE_S = 60.0


def train_learner(config: RunConfig, workdir: str | pathlib.Path, say: Say = print) -> dict:
  """The learner job: trains on rollout files as they come, publishes every version."""
  run, learner, start, accuracy_before = begin(config, workdir, say)
  files = RolloutFiles(run.workdir / "rollouts", config.mesh.generators)
  index = distributed.agree(max(int(learner.restored_meta.get("rollout_index", 0)),
                                files.progress()["done"]))
  expired_files = 0
  if distributed.lead():
    files.clear_done()
    expired_files = files.expire_below(index)
  if expired_files:
    say(f"rlx: learner: deleted {expired_files} rollout file(s) consumed before the restart")
  k = config.mesh.max_staleness
  step, dropped, expired_batches = start or 0, 0, 0
  controller = Controller.from_config(config)
  controller.restore(learner.restored_meta.get("control"))
  setting = int(learner.restored_meta.get("control_setting", 0))

  def tell_generator():
    if distributed.lead():
      files.write_control({"k": controller.k, "temperature": controller.temperature,
                           "setting": setting})

  def react(events):
    nonlocal setting
    setting += any(event.knob == "k" for event in events)
    apply(events, controller, say)
    if events:
      tell_generator()

  tell_generator()
  data_state = run.stream.get_state()
  sink = MetricsSink(run.workdir, config.logging, total_steps=config.trainer.steps,
                     resume_step=start, write=jax.process_index() == 0)
  try:
    with StopSignal(say=say) as stop, sink, ProfileWindow(
        config.logging, run.workdir / "profile", jax.process_index(), say) as profile:
      waited_since = time.perf_counter()
      while step < config.trainer.steps and not stop.agree():
        profile.at(step)
        # process 0 looks for the file, and every process of the job follows its answer
        if not distributed.agree(files.path(index).is_file()):
          if time.perf_counter() - waited_since > NOTICE_S:
            source = ("the generator job" if files.generators == 1
                      else f"generator job {index % files.generators}")
            say(f"rlx: learner: waiting for rollout file {files.path(index)} from {source}")
            waited_since = time.perf_counter()
          time.sleep(POLL_S)
          continue
        draw, extra = _read(files, index)
        lag_mean, lag_max = lag(draw, learner.version)  # of the whole batch: the same everywhere
        # only batches started under the current k tell the controller about it
        current = extra.get("setting", 0) == setting
        draw = _local_share(draw)
        received = time.perf_counter()
        too_old = distributed.agree(  # clocks differ between hosts: process 0 decides
            bool(controller.expired(lag_max, time.time() - draw.born)))
        if expired(draw, learner.version, k) or too_old:
          dropped += not too_old
          expired_batches += too_old
          if distributed.lead():
            files.finish(index, draw.data_state)
          index += 1
          if too_old and current:
            react(controller.observe(step, lag_mean=lag_mean))
          continue
        learner.clip_eps_high = controller.clip_eps_high
        metrics = learner.learn(draw)
        learned = time.perf_counter()
        sync_seconds = learner.publish()
        if distributed.lead():  # after the publish: the generator's gate opens
          files.finish(index, draw.data_state)
        index += 1
        step += 1
        data_state = draw.data_state
        finished = time.perf_counter()
        elapsed = finished - waited_since
        react(controller.observe(step, lag_mean=lag_mean if current else None,
                                 is_clip_frac=metrics["policy/is_clip_frac"],
                                 entropy=metrics["policy/entropy"]))
        metrics.update(controller.metrics())
        if controller.expires:
          metrics["rollout/expired_batches"] = expired_batches
        metrics.update(device_memory())
        if files.generators > 1:
          metrics["rollout/generator"] = (index - 1) % files.generators  # which job wrote it
        metrics.update({
            "rollout/index": index - 1, "rollout/dropped_batches": dropped,
            # prompts the generator had drawn after this batch: its consecutive batches
            # never repeat or skip prompts, across restarts too
            "data/prompts_drawn": int(draw.data_state.get("next_index", -1)),
            "rollout/expired_files": expired_files,
            "time/step_s": elapsed, "time/wait_for_data_s": received - waited_since,
            "time/generate_s": draw.generate_seconds, "time/learn_s": learned - received,
            "time/sync_s": sync_seconds, "time/generator_sync_s": extra["generator_sync_s"],
            **throughput(draw, elapsed)})
        waited_since = finished
        if evaluation_due(config, step, stop.agreed):
          metrics.update(evaluate(run, learner.generation_params()))
        sink.write(step, metrics)
        if learner.checkpoint_due(step, stop.agreed):
          learner.save(step, data_state, rollout_index=index, control=controller.state(),
                       control_setting=setting)
        learner.export_due(step)
      summary = finish(run, learner, start=start, step=step, stop=stop, data_state=data_state,
                       accuracy_before=accuracy_before, metrics_path=sink.jsonl_path, say=say,
                       save_meta={"rollout_index": index, "control": controller.state(),
                                  "control_setting": setting})
  finally:
    run.close()
  if not summary["stopped"] and distributed.lead():
    files.mark_done()  # the generator job exits; a stopped learner's generator waits for it
  return dict(summary, dropped_batches=dropped, expired_batches=expired_batches,
              control_events=[str(event) for event in controller.events])


def train_generator(config: RunConfig, workdir: str | pathlib.Path, say: Say = print) -> dict:
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
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), run.model.params)
  params, version, written, sync_seconds = None, -1, 0, 0.0
  waited_since = time.perf_counter()
  try:
    with StopSignal(say=say) as stop:
      while not files.done() and not stop.requested:
        # the learner's progress and controller settings, as process 0 reads them
        seen = json.loads(distributed.agree(json.dumps(
            {"done": files.progress()["done"], "control": files.control() or {}})))
        k = seen["control"].get("k", config.mesh.max_staleness)
        gate_open = seen["done"] >= index - k
        newest = _latest(run, version, like) if gate_open else None
        if newest is not None:
          (params, version), sync_seconds = newest, run.sync.last_seconds
        if not gate_open or params is None:  # the learner is k batches behind, or not started
          if time.perf_counter() - waited_since > NOTICE_S:
            say(f"rlx: {name}: waiting for the learner job (rollout {index}, policy version "
                f"{version})")
            waited_since = time.perf_counter()
          time.sleep(POLL_S)
          continue
        try:
          draw = collect(run, lambda: (params, version),
                         seed=config.trainer.seed * 1_000_003 + index,
                         temperature=seen["control"].get("temperature"))
        except StopIteration:
          say(f"rlx: {name}: the data ran out after {config.data.num_epochs} epoch(s)")
          break
        files.write(index, draw, extra={"index": index, "generator_sync_s": sync_seconds,
                                        "setting": seen["control"].get("setting", 0)})
        index, written = index + jobs, written + 1
        waited_since = time.perf_counter()
  finally:
    run.close()
  say(f"rlx: {name}: wrote {written} rollout file(s); the next is {index}")
  return {"written": written, "next_index": index, "stopped": stop.requested}


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


def _latest(run, version: int, like) -> tuple | None:
  """The newest policy version above ``version``, retrying when the learner deletes the one
  being read (it keeps k + 2)."""
  for attempt in range(5):
    try:
      return run.sync.latest(newer_than=version, like=like)
    except (FileNotFoundError, ValueError, OSError):
      if attempt == 4:
        raise
      time.sleep(POLL_S)
  return None
