"""The colocated loop: generate -> score -> learn on the same devices, time-sliced, always
on-policy (every rollout comes from the current params).

    summary = train_colocated(config, workdir)

Each step: params are resharded in device memory from the learning layout (FSDP)
to the generation layout; a batch of groups is sampled and scored (with DAPO's
dynamic sampling, groups whose rewards are all equal are dropped and more
prompts drawn until the batch is full); the decode state is gone when
generation returns, so learning has the memory back; then one update. Metrics go
to the sink; checkpoints every ``checkpoint.every_steps`` and on SIGTERM /
SIGINT before exiting. A workdir with a checkpoint resumes from it.

Across processes (``mesh.multihost``): every process runs this loop on the same
prompt batches, samples and scores its share of them on its own devices, and
joins one SPMD update; stopping is agreed after every step, and only process 0
writes metrics.
"""

from __future__ import annotations

import functools
import json
import pathlib
import time
import zlib

import jax

from rlx import distributed
from rlx.checkpoint import StopSignal
from rlx.metrics import MetricsSink, ProfileWindow
from rlx.trainer.common import (Say, collect, device_memory, evaluate, evaluation_due,
                               throughput)
from rlx.trainer.control import Controller
from rlx.trainer.learner import begin, finish


def train_colocated(config, workdir: str | pathlib.Path, say: Say = print) -> dict:
  """Runs (or resumes) a colocated run; returns a summary with the eval accuracy before and after."""
  run, learner, start, accuracy_before = begin(config, workdir, say)
  try:
    return _loop(config, run, learner, start, accuracy_before, say)
  finally:
    run.close()


def _loop(config, run, learner, start, accuracy_before, say) -> dict:
  params, version = run.sync.latest(like=learner.abstract_params)
  step = start or 0
  controller = Controller.from_config(config)  # the entropy floor (data here is never stale)
  controller.restore(learner.restored_meta.get("control"))
  sink = MetricsSink(run.workdir, config.logging, total_steps=config.trainer.steps,
                     resume_step=start, write=jax.process_index() == 0)
  with StopSignal(say=say) as stop, sink, ProfileWindow(
      config.logging, run.workdir / "profile", jax.process_index(), say) as profile:
    while step < config.trainer.steps and not stop.agreed:
      profile.at(step)
      started = time.perf_counter()
      try:
        draw = collect(run, functools.partial(tuple, (params, version)),
                       seed=config.trainer.seed * 1_000_003 + step,
                       temperature=controller.temperature)
      except StopIteration:  # a finite data.num_epochs is used up
        say(f"rlx: the data ran out after {config.data.num_epochs} epoch(s), at step {step}")
        break
      learn_started = time.perf_counter()
      learner.clip_eps_high = controller.clip_eps_high
      metrics = learner.learn(draw)
      learned = time.perf_counter()
      learner.publish()
      params, version = run.sync.latest(like=learner.abstract_params)
      step += 1
      for event in controller.observe(step, lag_mean=None, entropy=metrics["policy/entropy"]):
        say(f"rlx: control: {event}")
      metrics.update(controller.metrics())
      elapsed = time.perf_counter() - started
      metrics.update({
          "time/step_s": elapsed, "time/generate_s": draw.generate_seconds,
          "time/learn_s": learned - learn_started, "time/sync_s": time.perf_counter() - learned,
          **throughput(draw, elapsed), **device_memory()})
      stopping = stop.agree()  # every process stops after the same step
      if config.mesh.check_agreement:
        distributed.check_same(
            {"step": step, "policy_version": learner.version,
             "data_state": zlib.crc32(json.dumps(draw.data_state, sort_keys=True).encode())},
            f"the loop's state after step {step}")
      if evaluation_due(config, step, stopping):
        metrics.update(evaluate(run, params))
      sink.write(step, metrics)
      if learner.checkpoint_due(step, stopping):
        learner.save(step, draw.data_state, control=controller.state())
      learner.export_due(step)
    return finish(run, learner, start=start, step=step, stop=stop,
                  data_state=run.stream.get_state(), accuracy_before=accuracy_before,
                  metrics_path=sink.jsonl_path, say=say,
                  save_meta={"control": controller.state()})
