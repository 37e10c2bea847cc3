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
"""

from __future__ import annotations

import functools
import pathlib
import time

import jax

from rlx.checkpoint import StopSignal
from rlx.metrics import MetricsSink
from rlx.trainer.common import Learner, Say, collect, evaluate, prepare


def train_colocated(config, workdir: str | pathlib.Path, say: Say = print) -> dict:
  """Runs (or resumes) a colocated run; returns a summary with the eval accuracy before and after."""
  run = prepare(config, workdir, say)
  learner = Learner(run)
  start = learner.restore()
  if start is not None:
    say(f"rlx: resumed from {learner.checkpointer.directory} at step {start}")
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), learner.state.params)
  run.sync.publish(learner.state.params, learner.version)
  params, version = run.sync.latest(like=like)
  accuracy_before = evaluate(run, params) if start is None else None
  if accuracy_before is not None:
    say(f"rlx: held-out accuracy before RL: {accuracy_before:.1%}")
  step = start or 0
  sink = MetricsSink(run.workdir, config.logging, total_steps=config.trainer.steps,
                     resume_step=start, write=jax.process_index() == 0)
  with StopSignal() as stop, sink:
    while step < config.trainer.steps and not stop.requested:
      started = time.perf_counter()
      draw = collect(run, functools.partial(tuple, (params, version)),
                     seed=config.trainer.seed * 1_000_003 + step)
      learn_started = time.perf_counter()
      metrics = learner.learn(draw)
      learned = time.perf_counter()
      run.sync.publish(learner.state.params, learner.version)
      params, version = run.sync.latest(like=like)
      step += 1
      elapsed = time.perf_counter() - started
      tokens = sum(len(c.response_tokens) for c in draw.completions)
      metrics.update({
          "time/step_s": elapsed, "time/generate_s": draw.generate_seconds,
          "time/learn_s": learned - learn_started, "time/sync_s": time.perf_counter() - learned,
          "throughput/tokens_per_s": tokens / elapsed,
          "throughput/samples_per_s": len(draw.completions) / elapsed})
      if config.trainer.eval_every and step % config.trainer.eval_every == 0:
        metrics["eval/accuracy"] = evaluate(run, params)
      sink.write(step, metrics)
      if stop.requested or (config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0):
        learner.save(step, draw.data_state)
    if stop.requested:
      say(f"rlx: {stop.received}: checkpoint saved at step {step}; rerun the same command to resume")
    elif start != step and (config.checkpoint.every_steps == 0 or step % config.checkpoint.every_steps):
      learner.save(step, run.stream.get_state())
  learner.close()
  accuracy_after = evaluate(run, params)
  run.close()
  return {"steps": step, "eval_accuracy_before": accuracy_before,
          "eval_accuracy_after": accuracy_after, "metrics": str(sink.jsonl_path),
          "checkpoints": str(learner.checkpointer.directory), "stopped": stop.requested}
