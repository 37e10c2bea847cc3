"""The learner loop's side work after each step, as hooks: the step's samples, its held-out
evaluation, its metrics, its checkpoint and its export each run when they are due, in the
order given, and see one ``AfterStep``.

    hooks = [Hook("evaluation", config.trainer.eval_every, evaluate_step, at_last=True,
                  on_stop=False), ...]
    run_hooks(hooks, AfterStep(step, draw, metrics, data_state, stopping, last))

One rule says when work done every N steps is due (``common.due``); a hook adds only what differs:
whether it also runs after the last step, and whether a step after which the run stops always
runs it (the checkpoint) or never does (the evaluation: a stop takes seconds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from rlx.trainer.common import due
from rlx.trainer.draw import Draw


@dataclasses.dataclass
class AfterStep:
  """What the hooks see after a step."""

  step: int
  draw: Draw
  metrics: dict
  """The step's metrics, written by the metrics hook: hooks before it may add to them."""
  data_state: dict
  stopping: bool
  """The run stops after this step (agreed across processes)."""
  last: bool
  """It is the run's last step (``trainer.steps``) and the run is not stopping."""
  evaluated: dict | None = None
  """The held-out evaluation's figures, when it ran after this step."""


@dataclasses.dataclass(frozen=True)
class Hook:
  """Side work after a step, due every ``every`` steps (0: never)."""

  name: str
  every: int
  work: Callable[[AfterStep], None]
  at_last: bool = False
  """Also after the last step, whatever its period."""
  on_stop: bool | None = None
  """After a step the run stops at: always (True), never (False) or when due (None)."""

  def is_due(self, after: AfterStep) -> bool:
    if after.stopping and self.on_stop is not None:
      return self.on_stop
    return (after.last and self.at_last) or due(self.every, after.step)


def run_hooks(hooks: Sequence[Hook], after: AfterStep) -> None:
  """Runs the hooks due after a step, in order."""
  for hook in hooks:
    if hook.is_due(after):
      hook.work(after)
