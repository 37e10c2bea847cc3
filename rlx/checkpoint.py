"""Checkpoints of a run with Orbax: the train state (params, optimizer, step, RNG key, policy
version), the critic's state, the data stream's position and small metadata.

    checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint)
    checkpointer.save(step, state, data_state=stream.get_state(), meta={...})
    restored = checkpointer.restore(like_state)          # newest step, in like_state's shardings

Saves are asynchronous (training goes on while tensorstore writes) unless
``async_save`` is off; ``wait()`` blocks until they are on disk. ``StopSignal``
turns SIGTERM / SIGINT into a flag the trainer checks between steps, so it can
save and exit cleanly instead of dying mid-write.
"""

from __future__ import annotations

import dataclasses
import pathlib
import signal
from typing import Any

import jax
import orbax.checkpoint as ocp

from rlx.config import CheckpointConfig
from rlx.types import TrainState


@dataclasses.dataclass
class Restored:
  """What a checkpoint holds."""

  step: int
  state: TrainState
  critic: TrainState | None
  data_state: dict
  meta: dict


def _to_disk(state: TrainState) -> TrainState:
  return state.replace(key=jax.random.key_data(state.key))  # typed keys are not serialisable


def _from_disk(state: TrainState) -> TrainState:
  return state.replace(key=jax.random.wrap_key_data(state.key))


def _abstract(state: TrainState):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      _to_disk(state))


class Checkpointer:
  """Keeps the newest ``max_to_keep`` checkpoints of a run under ``directory``."""

  def __init__(self, directory: str | pathlib.Path, config: CheckpointConfig = CheckpointConfig()):
    self.directory = pathlib.Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(max_to_keep=config.max_to_keep,
                                           enable_async_checkpointing=config.async_save, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: TrainState, *, critic: TrainState | None = None,
           data_state: dict | None = None, meta: dict | None = None) -> None:
    """Starts writing checkpoint ``step`` (returns before it is on disk when async)."""
    items = {"state": ocp.args.StandardSave(_to_disk(state)),
             "data": ocp.args.JsonSave(data_state or {}),
             "meta": ocp.args.JsonSave(meta or {})}
    if critic is not None:
      items["critic"] = ocp.args.StandardSave(_to_disk(critic))
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, like: TrainState, *, like_critic: TrainState | None = None,
              step: int | None = None) -> Restored | None:
    """The checkpoint ``step`` (default: newest) in the shardings of ``like``; None if there is none."""
    step = self._manager.latest_step() if step is None else step
    if step is None:
      return None
    items = {"state": ocp.args.StandardRestore(_abstract(like)), "data": ocp.args.JsonRestore(),
             "meta": ocp.args.JsonRestore()}
    if like_critic is not None:
      items["critic"] = ocp.args.StandardRestore(_abstract(like_critic))
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    critic = _from_disk(restored["critic"]) if like_critic is not None else None
    return Restored(step=step, state=_from_disk(restored["state"]), critic=critic,
                    data_state=dict(restored["data"]), meta=dict(restored["meta"]))

  def wait(self) -> None:
    """Blocks until every started save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


class StopSignal:
  """Within ``with StopSignal() as stop:``, SIGTERM and SIGINT set ``stop.requested``.

  A second SIGINT while a stop is pending raises ``KeyboardInterrupt`` as usual.
  """

  def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
    self.signals, self.requested, self.received = signals, False, None
    self._previous: dict[int, Any] = {}

  def _handle(self, signum, frame):
    if self.requested and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.requested, self.received = True, signal.Signals(signum).name

  def __enter__(self):
    for sig in self.signals:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
