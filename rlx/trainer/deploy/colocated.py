"""The colocated deployment: generate -> score -> learn on the same devices, time-sliced,
always on-policy (every rollout comes from the current params).

    summary = train_colocated(config, workdir)

Each step: params are resharded in device memory from the learning layout (FSDP) to the
generation layout; a batch of groups is sampled and scored (with DAPO's dynamic sampling,
groups whose rewards are all equal are dropped and more prompts drawn until the batch is
full); the decode state is gone when generation returns, so learning has the memory back;
then one update. The loop itself is ``rlx.trainer.learn.loop``; this module owns the source that
samples inline.

Across processes (``mesh.multihost``): every process samples and scores its share of the
same prompt batches on its own devices, and joins one SPMD update.
"""

from __future__ import annotations

import pathlib

from rlx.trainer import control
from rlx.trainer.produce.collect import collect
from rlx.trainer.common import Say
from rlx.trainer.setup.run import Run
from rlx.trainer.produce.evaluate import evaluate
from rlx.trainer.learn.loop import Batch, BatchSource, Summary, learn_run


class InlineSource(BatchSource):
  """Samples a batch with the newest published weights when the loop asks for one."""

  def __init__(self, run: Run, first_step: int, temperature: float):
    self.run, self.index, self.temperature = run, first_step, temperature

  def next(self, version: int, wait: bool = True) -> Batch | None:
    if not wait:
      return None  # nothing is ever ready without sampling
    params, published = self.run.sync.latest()
    draw = collect(self.run, lambda: (params, published),
                   seed=self.run.config.trainer.seed * 1_000_003 + self.index,
                   temperature=self.temperature)
    self.index += 1
    return Batch(draw, draw.data_state)

  def retune(self, controller: control.Controller) -> None:
    self.temperature = controller.temperature


def train_colocated(config, workdir: str | pathlib.Path, say: Say = print) -> Summary:
  """Runs (or resumes) a colocated run; returns its summary."""
  # the controller keeps the entropy floor (the data is never stale)
  return learn_run(config, workdir, say, evaluate,
                   lambda run, learner, start, controller: InlineSource(
                       run, start or 0, controller.temperature))
