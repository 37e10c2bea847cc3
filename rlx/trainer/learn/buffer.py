"""A replay buffer of scored groups with aging, in front of any batch source.

    source = buffered(source, config, controller, restored_meta)   # when buffer.enabled
    buffer = ReplayBuffer.from_config(config, fresh=controller.fresh)
    buffer.put(draw)                              # a batch from the generator, split into groups
    draw = buffer.take(version, now=time.time())  # a training batch, or None
    buffer.metrics(now)                           # buffer/size, buffer/evicted, buffer/age_mean_s ...

Groups (one prompt's ``rollout.group_size`` samples) are the unit: the group-relative
advantage needs a whole group, and nothing else ties samples together. Each group keeps
the oldest policy version among its rollouts, the wall-clock time its sampling started,
its sampling temperature, and how many updates have used it.

Double buffering: the generator's batches arrive on one side (``put``; the generator
thread keeps sampling into its hand-over queue meanwhile), and the learner takes its
batches from the other (``take``), which first moves every arrived group across. So the
learner trains whenever ``data.prompts_per_step`` usable groups exist, without waiting
for the generator's next batch:

- a group is evicted (and counted) once the controller no longer calls it fresh (its lag
  past the bound k or the lag threshold, or its age past ``data.max_age_s``: the one rule
  of ``rlx.trainer.control``), or when the buffer holds more than ``buffer.capacity``
  groups (oldest first);
- ``take`` picks the least-used groups first, newest among equals, all sampled at the
  temperature of the newest group (a batch has one sampling temperature); a group leaves
  once it has been trained on ``buffer.reuse`` times.

The buffer's groups are saved in the learner's checkpoint (``state``/``restore``), so a
resumed run loses none of them.

``BufferedSource`` puts the buffer in front of any batch source of ``rlx.trainer.learn.loop``
(inline, thread or files): the learner trains whenever the buffer can make a batch, and
waits for the source only when it cannot.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from rlx.config import RunConfig
from rlx.rollout import Completion
from rlx.trainer import control
from rlx.trainer.draw import Draw
from rlx.trainer.draw import decode, encode
from rlx.trainer.learn.source import Batch, BatchSource


@dataclasses.dataclass
class Group:
  completions: list[Completion]
  rewards: np.ndarray
  correct: np.ndarray
  version: int
  """The oldest policy version among the group's rollouts."""
  born: float
  """Wall-clock time (``time.time()``) its sampling started."""
  temperature: float | None
  uses: int = 0


class ReplayBuffer:
  """Groups waiting to be trained on (see the module docstring)."""

  def __init__(self, *, group_size: int, groups_per_batch: int, capacity: int, reuse: int,
               fresh: Callable[[int, float], bool]):
    """``fresh(lag, age_s)``: whether a group ``lag`` versions behind, sampled ``age_s``
    seconds ago, may still be trained on (``Controller.fresh``)."""
    self.group_size, self.groups_per_batch = group_size, groups_per_batch
    self.capacity, self.reuse, self.fresh = capacity, reuse, fresh
    self._arrived: list[Group] = []  # the side the generator's batches land on
    self._ready: list[Group] = []    # the side the learner takes from
    self._counts: dict | None = None  # the newest arrived draw's sampling metrics
    self.evicted = 0
    self.reused = 0
    """Groups taken again after their first use."""

  @classmethod
  def from_config(cls, config: RunConfig, fresh: Callable[[int, float], bool]) -> ReplayBuffer:
    return cls(group_size=config.rollout.group_size, groups_per_batch=config.data.prompts_per_step,
               capacity=config.buffer.capacity, reuse=config.buffer.reuse, fresh=fresh)

  def put(self, draw: Draw) -> None:
    """Adds ``draw``'s groups (its rows are whole groups, in order)."""
    g = self.group_size
    for start in range(0, len(draw.completions), g):
      rows = draw.completions[start:start + g]
      self._arrived.append(Group(rows, np.asarray(draw.rewards[start:start + g]),
                                 np.asarray(draw.correct[start:start + g]),
                                 min(c.policy_version for c in rows), draw.born,
                                 draw.temperature))
    self._counts = draw.counts

  def __len__(self) -> int:
    return len(self._arrived) + len(self._ready)

  def _evict(self, version: int, now: float) -> None:
    self._ready += self._arrived  # swap: everything arrived is the learner's now
    self._arrived = []
    kept = [group for group in self._ready if self.fresh(version - group.version, now - group.born)]
    kept.sort(key=lambda group: group.born)
    overflow = max(0, len(kept) - self.capacity)
    self.evicted += len(self._ready) - len(kept) + overflow
    self._ready = kept[overflow:]

  def take(self, version: int, now: float) -> Draw | None:
    """A batch of ``groups_per_batch`` groups for the learner at ``version``, or None when
    too few usable groups are left."""
    self._evict(version, now)
    if not self._ready:
      return None
    temperature = max(self._ready, key=lambda group: group.born).temperature
    usable = [group for group in self._ready if group.temperature == temperature]
    if len(usable) < self.groups_per_batch:
      return None
    usable.sort(key=lambda group: (group.uses, -group.born))
    chosen = usable[:self.groups_per_batch]
    for group in chosen:
      self.reused += group.uses > 0
      group.uses += 1
    self._ready = [group for group in self._ready if group.uses < self.reuse]
    counts, self._counts = self._counts or {}, None  # a new draw's sampling metrics, once
    return Draw(completions=[c for group in chosen for c in group.completions],
                rewards=np.concatenate([group.rewards for group in chosen]).astype(np.float32),
                correct=np.concatenate([group.correct for group in chosen]).astype(bool),
                counts=counts, generate_seconds=0.0, data_state={}, temperature=temperature,
                born=min(group.born for group in chosen))

  def metrics(self, now: float) -> dict[str, float]:
    groups = self._arrived + self._ready
    ages = [now - group.born for group in groups]
    return {"buffer/size": len(groups), "buffer/evicted": self.evicted,
            "buffer/reused": self.reused,
            "buffer/age_mean_s": float(np.mean(ages)) if ages else 0.0}

  # --- checkpoints -------------------------------------------------------------------------------

  def state(self) -> dict:
    """The buffer's groups and counters, JSON-ready (for the checkpoint's metadata)."""
    groups = self._ready + self._arrived
    draw = Draw(completions=[c for group in groups for c in group.completions],
                rewards=(np.concatenate([group.rewards for group in groups]) if groups
                         else np.zeros(0)),
                correct=(np.concatenate([group.correct for group in groups]) if groups
                         else np.zeros(0, bool)),
                counts={}, generate_seconds=0.0, data_state={})
    return {"groups": base64.b64encode(encode(draw)).decode("ascii"),
            "born": [group.born for group in groups], "uses": [group.uses for group in groups],
            "temperature": [group.temperature for group in groups],
            "evicted": self.evicted, "reused": self.reused}

  def restore(self, state: dict | None) -> None:
    if not state:
      return
    draw, _ = decode(base64.b64decode(state["groups"]))
    g = self.group_size
    self._arrived, self._ready = [], []
    for i, (born, uses, temperature) in enumerate(zip(state["born"], state["uses"],
                                                      state["temperature"])):
      rows = draw.completions[i * g:(i + 1) * g]
      self._ready.append(Group(rows, draw.rewards[i * g:(i + 1) * g],
                               draw.correct[i * g:(i + 1) * g],
                               min(c.policy_version for c in rows), born, temperature, uses))
    self.evicted, self.reused = int(state["evicted"]), int(state["reused"])


class BufferedSource(BatchSource):
  """A ``ReplayBuffer`` in front of a batch source: arrivals go into the buffer, batches come
  out of it, and the source is waited on only while the buffer cannot make a batch."""

  def __init__(self, source: BatchSource, buffer: ReplayBuffer, data_state: dict):
    self.source, self.buffer = source, buffer
    self.data_state = data_state
    """The position after the newest arrival: the buffer's groups are saved with it."""
    self._starved = True
    self._arrived: Batch | None = None

  def next(self, version: int, wait: bool = True) -> Batch | None:
    arrived = self.source.next(version, wait=wait and self._starved)
    if arrived is not None:
      self.buffer.put(arrived.draw)
      # it is the buffer's now: the gate moves on
      self.source.settle(arrived, control.TRAIN, version)
      self.data_state, self._arrived = arrived.data_state, arrived
    draw = self.buffer.take(version, time.time())
    self._starved = draw is None
    if draw is None:
      return None
    # only this step's arrival, if any, speaks for the source's current setting
    latest, self._arrived = self._arrived, None
    return Batch(draw, self.data_state, current=latest is None or latest.current,
                 metrics=dict(latest.metrics) if latest else {})

  # settle: nothing to do, the source settled each batch as it arrived

  def retune(self, controller: control.Controller) -> None:
    self.source.retune(controller)

  def metrics(self, learn_seconds: float) -> dict:
    return {**self.source.metrics(learn_seconds), **self.buffer.metrics(time.time())}

  def state(self) -> dict:
    return {**self.source.state(), "buffer": self.buffer.state()}

  def close(self) -> None:
    self.source.close()


def buffered(source: BatchSource, config: RunConfig, controller: control.Controller,
             restored_meta: dict, data_state: dict) -> BatchSource:
  """``source`` behind a replay buffer when ``buffer.enabled`` (its groups restored from the
  checkpoint's metadata; ``data_state``: the data position now), else ``source`` itself."""
  if not config.buffer.enabled:
    return source
  buffer = ReplayBuffer.from_config(config, fresh=controller.fresh)
  buffer.restore(restored_meta.get("buffer"))
  return BufferedSource(source, buffer, data_state)
