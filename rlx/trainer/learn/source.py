"""What the learner loop takes batches from: a ``BatchSource`` hands over ``Batch``es (see
``rlx.trainer.learn.loop``); each deployment has its own source, any of them behind a replay
buffer (``rlx.trainer.learn.buffer``)."""

from __future__ import annotations

import dataclasses

from rlx.trainer import control
from rlx.trainer.draw import Draw


@dataclasses.dataclass
class Batch:
  """A batch as a source hands it to the loop."""

  draw: Draw
  data_state: dict
  """The data position a checkpoint taken after this batch resumes from."""
  current: bool = True
  """Whether it was started under the controller's current k: only such batches tell the
  controller about that k."""
  metrics: dict = dataclasses.field(default_factory=dict)
  """The source's own metrics of this batch (deployment-specific keys)."""
  policy_versions: list[int] | None = None
  """The policy version of every rollout of the whole batch, where ``draw`` holds only this
  process's share of it (None: the draw's own): the lag is the same on every process."""


class BatchSource:
  """Where the learner's batches come from (see the module docstring). A source overrides
  ``next`` and whichever of the rest it has something to do in; the defaults do nothing."""

  def next(self, version: int, wait: bool = True) -> Batch | None:
    """The next batch for a learner at policy ``version``, or None when none is ready (after
    waiting a short while when ``wait``: the loop checks for a stop and asks again). Raises
    ``StopIteration`` when the data ran out, and what a producer raised."""
    raise NotImplementedError

  def settle(self, batch: Batch, verdict: str, version: int) -> None:
    """The loop is done with ``batch``: trained on (after its weights were published),
    dropped or expired; ``version``: the learner's policy version now."""

  def retune(self, controller: control.Controller) -> None:
    """The controller changed a knob: sample with its k and temperature from now on."""

  def metrics(self, learn_seconds: float) -> dict:
    """The source's own metrics after a step whose learning took ``learn_seconds``."""
    return {}

  def state(self) -> dict:
    """What a checkpoint keeps of the source, beside the data position."""
    return {}

  def close(self) -> None:
    """Stops producers; never raises for a producer that already failed."""
