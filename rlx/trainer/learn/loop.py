"""The one learner loop, for every deployment: colocated, split in one process, and the
learner job of a split run as jobs.

    summary = learn_run(config, workdir, say, evaluate, make_source)   # begin, then the loop
    summary = learn_loop(run, learner, source, controller, start=..., accuracy_before=..., say=say)

Deployments differ only in where batches come from, a ``BatchSource``:

- ``InlineSource`` (colocated): samples a batch with the current weights when asked;
- ``ThreadSource`` (split in one process): a generator thread on the generation sub-mesh;
- ``FileSource`` (the learner job): rollout files written by generator jobs;

any of them behind a ``BufferedSource`` when ``buffer.enabled``. One pass of the loop:

1. take a batch from the source (``None``: nothing yet; the loop asks again);
2. ask the controller for its verdict: train, drop (past the bound k) or expire (past the
   lag threshold or the age limit), agreed across the job's processes;
3. tell the source what happened to the batch (a generator's gate opens on it);
4. learn, with the controller's knobs passed as arguments;
5. publish the new weights;
6. let the controller observe the step, and retune the source with its new knobs;
7. merge the metrics: the same keys in every deployment, plus the source's own;
8. evaluate, write the metrics, checkpoint (with the source's and the controller's state),
   export.

Stopping always goes through the cross-process agreement (``StopSignal.agree``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time
import zlib
from collections.abc import Callable

import jax

from rlx import cli, distributed, progress
from rlx.checkpoint import CheckpointError, StopSignal
from rlx.config import RunConfig
from rlx.data import DataError
from rlx.metrics import MetricsSink, ProfileWindow
from rlx.trainer import control
from rlx.trainer.common import Evaluate, RewardFailedError, Say, device_memory, throughput
from rlx.trainer.learn.health import Health, describe_sample, sample_rows
from rlx.trainer.setup.run import Run
from rlx.trainer.learn.learner import Learner
from rlx.trainer.draw import Draw
from rlx.trainer.learn.buffer import buffered
from rlx.trainer.learn.hooks import AfterStep, Hook, run_hooks
from rlx.trainer.learn.source import Batch, BatchSource
from rlx.trainer.learn.lifecycle import begin, finish, timed


@dataclasses.dataclass(frozen=True)
class Summary:
  """How a run ended."""

  steps: int
  stopped: bool
  """Stopped by a signal (saved; rerunning resumes) rather than finished."""
  seconds: dict
  eval_accuracy_before: float | None
  eval_accuracy_after: float | None
  metrics: str
  checkpoints: str
  dropped_batches: int = 0
  expired_batches: int = 0
  control_events: tuple[str, ...] = ()
  first_step: int = 0
  """The step it resumed from (0: a fresh run): this process ran the steps after it."""


def learn_run(config: RunConfig, workdir: str | pathlib.Path, say: Say, evaluate: Evaluate,
              make_source: Callable[[Run, Learner, int | None, control.Controller], BatchSource],
              learner_delay_s: float = 0.0) -> Summary:
  """The start sequence of every deployment, then the loop: the run begun (``begin``), its
  controller restored from the checkpoint, the deployment's batch source
  (``make_source(run, learner, resumed_step, controller)``) behind the replay buffer when
  ``buffer.enabled``, and ``learn_loop`` until the run ends."""
  started = begin(config, workdir, say, evaluate)
  run, learner = started.run, started.learner
  controller = control.Controller.from_config(config)
  controller.restore(learner.restored_meta.get("control"))
  source = buffered(make_source(run, learner, started.step, controller), config, controller,
                    learner.restored_meta, run.stream.get_state())
  return learn_loop(run, learner, source, controller, start=started.step,
                    accuracy_before=started.accuracy_before, say=say, evaluate=evaluate,
                    seconds=started.seconds, learner_delay_s=learner_delay_s)


def learn_loop(run: Run, learner: Learner, source: BatchSource, controller: control.Controller,
               *, start: int | None, accuracy_before: float | None, say: Say,
               evaluate: Evaluate, seconds: dict[str, float] | None = None,
               learner_delay_s: float = 0.0) -> Summary:
  """Trains until ``trainer.steps`` (or a stop signal, or the data runs out); returns the
  summary. ``evaluate``: the held-out evaluation (the producing side's), run every
  ``trainer.eval_every`` steps and at the end; ``seconds``: where the time went before the
  loop (``begin``'s). ``learner_delay_s`` slows the learner down on purpose (tests and
  benchmarks of the staleness control)."""
  config = run.config
  loop_started, loop_evals = time.perf_counter(), {"evals": 0.0}
  evaluate = timed(evaluate, loop_evals)
  step = start or 0
  counts = {control.DROP: 0, control.EXPIRE: 0}
  sink = MetricsSink(run.workdir, config.logging, total_steps=config.trainer.steps,
                     resume_step=start, write=distributed.lead(), run_name=config.name,
                     run_config=json.loads(cli.to_json(config)))
  data_state = run.stream.get_state()
  final = None  # the final evaluation, when the last step ran it
  learning = {"tokens": 0.0, "seconds": 0.0}  # every process's tokens learned, over the run
  failing = 0  # steps in a row on which every reward call failed
  health = Health(config)  # a warning line when the run is not learning

  meta = functools.partial(_meta, run, controller, source)
  hooks = _hooks(run, learner, sink, evaluate, meta, say)
  try:
    with StopSignal(say=say, grace_s=config.checkpoint.stop_grace_s,
                    pending=cli.take_stop_at_start()) as stop, sink, ProfileWindow(
        config.logging, run.workdir / "profile", jax.process_index(), say) as profile:
      try:
        since = time.perf_counter()
        while step < config.trainer.steps and not stop.agree():
          profile.at(step)
          try:
            batch = source.next(learner.version)
          except StopIteration:  # a finite data.num_epochs is used up
            say(f"rlx: the data ran out after {config.data.num_epochs} epoch(s), at step {step}")
            break
          except DataError:
            _save_before_failing(learner, step, start, data_state, meta(), "a data error", say)
            raise
          if batch is None:
            continue
          received = time.perf_counter()
          draw = batch.draw
          failing = failing + 1 if draw.counts.get("reward/error_frac", 0.0) >= 1.0 else 0
          if failing >= config.reward.max_error_steps:
            _save_before_failing(learner, step, start, data_state, meta(),
                                 "a reward that never works", say)
            raise _reward_failed(run, failing)
          verdict, lag_mean = _judge(batch, learner, controller, source, counts, step, say)
          if verdict != control.TRAIN:
            continue
          _stop_on_a_failed_save(learner)
          metrics = learner.learn(draw, clip_eps_high=controller.clip_eps_high)
          if learner_delay_s:
            time.sleep(learner_delay_s)
          learned = time.perf_counter()
          sync_seconds = learner.publish()
          source.settle(batch, verdict, learner.version)
          data_state = batch.data_state
          step += 1
          finished = time.perf_counter()
          elapsed = finished - since
          _retune(controller.observe(step, lag_mean=lag_mean if batch.current else None,
                                     is_clip_frac=metrics["policy/is_clip_frac"],
                                     entropy=metrics["policy/entropy"]), controller, source, say)
          metrics.update(controller.metrics(), **_counted(run, controller, counts),
                         **_step_times(draw, learner, since, received, learned, finished,
                                       sync_seconds),
                         **throughput(draw, elapsed), **device_memory(), **batch.metrics,
                         **source.metrics(finished - received))
          learning["tokens"] += metrics["throughput/tokens_per_s"] * elapsed
          learning["seconds"] += finished - received
          metrics["throughput/learning_tokens_per_s"] = learning["tokens"] / learning["seconds"]
          for line in health.check(metrics):
            say(line)
          since = finished
          stopping = stop.agree()  # every process stops after the same step
          _check_agreement(config, step, learner, data_state)
          after = AfterStep(step, draw, metrics, data_state, stopping,
                            last=step == config.trainer.steps and not stopping)
          run_hooks(hooks, after)
          final = after.evaluated if after.last else final
      finally:
        source.close()
      ended = finish(run, learner, start=start, step=step, stop=stop, data_state=data_state,
                     say=say, evaluate=evaluate, seconds=seconds or {},
                     loop_started=loop_started, loop_evals=loop_evals, save_meta=meta(),
                     final=final)
      if final is None and ended["final"]:  # the loop ended early: the final evaluation too
        sink.write(step, ended["final"], force=True)
  finally:
    run.close()
  return Summary(steps=step, stopped=stop.agreed, seconds=ended["seconds"],
                 eval_accuracy_before=accuracy_before,
                 eval_accuracy_after=ended["eval_accuracy_after"], metrics=str(sink.jsonl_path),
                 checkpoints=str(learner.checkpointer.directory), **_tallied(controller, counts),
                 first_step=start or 0)


def _meta(run: Run, controller: control.Controller, source: BatchSource) -> dict:
  """What a checkpoint keeps beside the train state and the data position."""
  return {"control": controller.state(), "data_fingerprint": run.source.fingerprint(),
          **source.state()}


def _tallied(controller: control.Controller, counts: dict) -> dict:
  """The summary's count of the batches not trained on and the controller's events."""
  return {"dropped_batches": counts[control.DROP], "expired_batches": counts[control.EXPIRE],
          "control_events": tuple(str(event) for event in controller.events)}


def _hooks(run: Run, learner: Learner, sink: MetricsSink, evaluate: Evaluate, meta,
           say: Say) -> list[Hook]:
  """The side work after each step, in order: samples to ``samples.jsonl``, the held-out
  evaluation (the last step's is the final one, logged with its step and run once), the
  step's metrics, the checkpoint (always at a stop) and the Hugging Face export."""
  config = run.config

  def samples(after: AfterStep) -> None:
    _write_samples(run, after.step, after.draw, say)

  def evaluation(after: AfterStep) -> None:
    progress.doing(f"evaluating after step {after.step}")
    after.evaluated = evaluate(run, learner.generation_params())
    after.metrics.update(after.evaluated)

  def metrics(after: AfterStep) -> None:
    sink.write(after.step, after.metrics, force=after.last)

  def checkpoint(after: AfterStep) -> None:
    progress.doing(f"saving the checkpoint of step {after.step}")
    learner.save(after.step, after.data_state, **meta())

  def export(after: AfterStep) -> None:  # WORKDIR/hf/step_N
    learner.export(run.workdir / "hf" / f"step_{after.step}", run.tokenizer)

  return [Hook("samples", config.logging.samples_every, samples),
          Hook("evaluation", config.trainer.eval_every, evaluation, at_last=True, on_stop=False),
          Hook("metrics", 1, metrics),
          Hook("checkpoint", config.checkpoint.every_steps, checkpoint, on_stop=True),
          Hook("export", config.checkpoint.export_hf_every, export)]


def _step_times(draw: Draw, learner: Learner, since: float, received: float, learned: float,
                finished: float, sync_seconds: float) -> dict[str, float]:
  """Where a step's time went, from its clock readings (``time.perf_counter()``): since the
  last step, the batch received, learned on, the weights published and the step finished;
  and what the publish sent."""
  return {"time/step_s": finished - since, "time/wait_for_data_s": received - since,
          "time/generate_s": draw.generate_seconds, "time/learn_s": learned - received,
          "time/sync_s": sync_seconds, "sync/bytes": learner.sync_bytes,
          "sync/verified": learner.sync_verified}


def _judge(batch: Batch, learner: Learner, controller: control.Controller, source: BatchSource,
           counts: dict, step: int, say: Say) -> tuple[str, float]:
  """The controller's verdict on ``batch`` (agreed: process 0 decides, every process follows,
  since clocks differ between hosts) and its mean lag; a batch not trained is settled and
  counted here."""
  draw = batch.draw
  versions = batch.policy_versions or [c.policy_version for c in draw.completions]
  lag_mean, lag_max = control.lag(versions, learner.version)
  verdict = distributed.agree(controller.verdict(
      lag_max, time.time() - draw.born, lag_min=learner.version - max(versions)))
  if verdict != control.TRAIN:
    counts[verdict] += 1
    source.settle(batch, verdict, learner.version)
    if verdict == control.EXPIRE and batch.current:
      _retune(controller.observe(step, lag_mean=lag_mean), controller, source, say)
  return verdict, lag_mean


def _stop_on_a_failed_save(learner: Learner) -> None:
  """A save that failed (a full disk) stops the run before it trains another step that could
  not be saved; agreed, since every process writes its part of a checkpoint."""
  failed = learner.checkpointer.failed_save()
  if distributed.any_process(failed is not None):
    raise failed or CheckpointError("writing a checkpoint failed on another process: see its log")


def _reward_failed(run: Run, failing: int) -> RewardFailedError:
  config = run.config
  return RewardFailedError(
      f"every reward call of {failing} steps in a row failed (config.reward."
      f"max_error_steps={config.reward.max_error_steps}); the first error: "
      f"{run.pool.first_error or 'in the generator job: see its log'}. Fix the "
      f"reward function (config.reward.name={config.reward.name!r}) or the data's "
      "fields it reads; checkpoints so far are kept")


def _counted(run: Run, controller: control.Controller, counts: dict) -> dict[str, float]:
  """The batches the controller dropped (and expired, where it expires) and the rows skipped."""
  counted = {"rollout/dropped_batches": counts[control.DROP],
             "data/skipped_rows": run.source.skipped + run.stream.skipped}
  if controller.expires:
    counted["rollout/expired_batches"] = counts[control.EXPIRE]
  return counted


def _write_samples(run: Run, step: int, draw, say: Say) -> None:
  """A few groups' samples to samples.jsonl (process 0)."""
  logging = run.config.logging
  if not distributed.lead():
    return
  rows = sample_rows(step, draw, run.tokenizer, logging.samples_groups,
                     run.config.rollout.group_size)
  with open(run.workdir / "samples.jsonl", "a") as samples:
    samples.writelines(json.dumps(row) + "\n" for row in rows)
  if logging.samples_console and rows:
    say(describe_sample(rows[0]))


def _check_agreement(config: RunConfig, step: int, learner: Learner, data_state: dict) -> None:
  """With ``mesh.check_agreement``: every process holds the same step, version and data
  position after ``step``, or the run stops naming what differs."""
  if config.mesh.check_agreement:
    distributed.check_same(
        {"step": step, "policy_version": learner.version,
         "data_state": zlib.crc32(json.dumps(data_state, sort_keys=True).encode())},
        f"the loop's state after step {step}")


def _save_before_failing(learner: Learner, step: int, start: int | None, data_state: dict,
                         meta: dict, why: str, say: Say) -> None:
  """Saves the last completed step before the run stops on ``why`` (an error of the data or
  the reward, not of the model), so that fixing it and rerunning loses nothing. One process
  only: where several read their own rows, one failing alone cannot make the others save."""
  if step <= (start or 0) or step == learner.saved_step or jax.process_count() > 1:
    return
  learner.save(step, data_state, **meta)
  learner.checkpointer.wait()
  say(f"rlx: saved step {step} in {learner.checkpointer.directory} before stopping on {why}")


def _retune(events: list[control.Event], controller: control.Controller, source: BatchSource,
            say: Say) -> None:
  """Announces a controller's changes and hands the new knobs to the source."""
  for event in events:
    say(f"rlx: control: {event}")
  if events:
    source.retune(controller)
