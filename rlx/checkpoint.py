"""Checkpoints of a run with Orbax: the train state (params, optimizer, step, RNG key, policy
version), the critic's state, the data stream's position and small metadata.

    checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint)
    checkpointer.save(step, state, data_state=stream.get_state(), meta={...})
    restored = checkpointer.restore(like_state)          # newest step, in like_state's shardings

Saves are asynchronous (training goes on while tensorstore writes) unless
``async_save`` is off; ``wait()`` blocks until they are on disk. Orbax writes a
checkpoint under a temporary name and renames it when complete, so a kill at
any moment leaves the previous checkpoints intact. A state holding NaN or inf is
never saved. ``restore`` takes the newest checkpoint that reads back whole and
finite: a newer one that does not (truncated or deleted files, an empty
directory, NaN weights) is moved aside to ``DIR.unreadable/`` and named; when
none reads back, ``CheckpointError`` names the directory.

``StopSignal`` turns the first SIGTERM / SIGINT into a flag the trainer checks
between steps, so it can save and exit cleanly instead of dying mid-write; a
second one exits at once (what is complete on disk stays intact).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import shutil
import signal
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from rlx import distributed, progress
from rlx.config import CheckpointConfig
from rlx.types import TrainState

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
  """No checkpoint of a run's directory can be restored; the message names it and the fix."""


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


@jax.jit
def _all_finite(tree) -> jax.Array:
  """Whether every floating-point value of ``tree`` is finite (one reduction per leaf)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def finite(state: TrainState | None) -> bool:
  """Whether a train state's params and optimizer state hold only finite values."""
  return state is None or bool(_all_finite((state.params, state.opt_state)))


def _abstract(state: TrainState):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      _to_disk(state))


class _QuietWriteFailures(logging.Filter):
  """Drops Orbax's logged tracebacks of a background write that failed (a full disk: one per
  file of every checkpoint in flight, hundreds of lines). The write's exception is raised
  again by the next ``save`` or ``wait`` and reported once, as a ``CheckpointError``."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not ("orbax" in record.pathname and record.exc_info
                and record.levelno >= logging.ERROR)


_QUIET = _QuietWriteFailures()


def _quiet_unraisablehook(hook):
  """``sys.unraisablehook`` without the "Event loop is closed" errors of tensorstore's callbacks
  that fire after a failed checkpoint write's event loop is gone: dozens of tracebacks of one
  full disk, already reported as a ``CheckpointError``."""
  if getattr(hook, "rlx_quiet", False):
    return hook

  def quiet(unraisable):
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
      return
    hook(unraisable)

  quiet.rlx_quiet = True
  return quiet


class Checkpointer:
  """Keeps the newest ``max_to_keep`` checkpoints of a run under ``directory``."""

  def __init__(self, directory: str | pathlib.Path, config: CheckpointConfig = CheckpointConfig(),
               largest_bytes: int = 0):
    """``largest_bytes``: the largest array a save will write (the bound on the writes held at
    once, ``config.write_buffer_mb``, must hold it)."""
    logging.getLogger("absl").addFilter(_QUIET)  # once: a filter is added only if absent
    sys.unraisablehook = _quiet_unraisablehook(sys.unraisablehook)
    self.directory = pathlib.Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(max_to_keep=config.max_to_keep,
                                           enable_async_checkpointing=config.async_save, create=True)
    # tensorstore holds each array's encoded chunks until they are written: without a bound,
    # a whole state's worth at once
    # (a MiB over the largest array: the bound crosses a GB figure, and one array must fit)
    in_flight_gb = (max(config.write_buffer_mb << 20, largest_bytes) + (1 << 20)) / 1e9
    states = {name: ocp.StandardCheckpointHandler(save_concurrent_gb=in_flight_gb)
              for name in ("state", "critic")}
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers=dict(states, data=ocp.JsonCheckpointHandler(),
                           meta=ocp.JsonCheckpointHandler()))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """The steps of the checkpoints on disk, oldest first."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: TrainState, *, critic: TrainState | None = None,
           data_state: dict | None = None, meta: dict | None = None) -> None:
    """Starts writing checkpoint ``step`` (returns before it is on disk when async). A state
    holding NaN or inf is never written (``CheckpointError``): every checkpoint on disk is
    finite, so rotation under ``max_to_keep`` never deletes the newest finite one."""
    if not (finite(state) and finite(critic)):
      newest = self._manager.latest_step()
      raise CheckpointError(
          f"step {step}: the weights or optimizer state hold NaN or inf, so no checkpoint was "
          f"written; " + (f"the newest checkpoint, step {newest} in {self.directory}, is the last "
                          "good one" if newest is not None else "no checkpoint exists yet"))
    items = {"state": ocp.args.StandardSave(_to_disk(state)),
             "data": ocp.args.JsonSave(data_state or {}),
             "meta": ocp.args.JsonSave(meta or {})}
    if critic is not None:
      items["critic"] = ocp.args.StandardSave(_to_disk(critic))
    try:
      self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    except Exception as error:  # noqa: BLE001 - a full disk, a lost mount: said plainly
      raise self._write_failed(error) from error

  def _write_failed(self, error: BaseException) -> CheckpointError:
    try:
      self._manager.reload()
      newest = self._manager.latest_step()
    except Exception:  # noqa: BLE001
      newest = None
    kept = (f"the newest complete checkpoint, step {newest}, is intact" if newest is not None
            else "no complete checkpoint exists yet")
    return CheckpointError(
        f"writing a checkpoint to {self.directory} failed ({type(error).__name__}: "
        f"{str(error)[:300]}); {kept}. Free space there (or point --workdir elsewhere) and rerun "
        "the same command to resume")

  def restore(self, like: TrainState, *, like_critic: TrainState | None = None,
              step: int | None = None, say=print, usable=None) -> Restored | None:
    """The checkpoint ``step`` (default: the newest that reads back whole) in the shardings of
    ``like``; None if there is none.

    Newer checkpoints that do not read back are moved aside to ``DIR.unreadable/`` (and
    ``say`` names them); if none reads back, raises ``CheckpointError``. ``usable(restored)``,
    when given, may raise to say that a checkpoint that read back cannot be used (a data
    position the data stream refuses): it is then treated like one that did not read back.
    """
    if step is not None:
      return self._restore(step, like, like_critic)
    steps = sorted(self._manager.all_steps(), reverse=True)
    failures = []
    for candidate in steps:
      try:
        restored = self._restore(candidate, like, like_critic)
        if usable is not None:
          usable(restored)
      except Exception as error:  # noqa: BLE001 - any failure to read means "not this one"
        failures.append((candidate, f"{type(error).__name__}: {str(error)[:300]}"))
        continue
      for bad, why in failures:
        aside = self._set_aside(bad)
        say(f"rlx: checkpoint step {bad} does not read back ({why}); moved it to {aside}")
      return restored
    if failures:
      step, why = failures[0]
      raise CheckpointError(
          f"no checkpoint in {self.directory} reads back (newest, step {step}: {why}). If the "
          "config changed since they were written, restore it; otherwise move that directory "
          "away to start the run over")
    return None

  def read_meta(self) -> tuple[int, dict] | None:
    """The newest checkpoint's step and metadata alone (the state not read), or None when
    there is none or its metadata does not read back."""
    steps = self._manager.all_steps()
    if not steps:
      return None
    step = max(steps)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception:  # noqa: BLE001 - unreadable: restore says why, step by step
      return None
    return step, dict(restored["meta"])

  def _set_aside(self, step: int) -> pathlib.Path:
    """Moves checkpoint ``step`` out of the manager's sight (never deletes it)."""
    aside = self.directory.with_name(self.directory.name + ".unreadable")
    aside.mkdir(parents=True, exist_ok=True)
    target = aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    shutil.move(str(self.directory / str(step)), str(target))
    self._manager.reload()
    return target

  def _restore(self, step: int, like: TrainState, like_critic: TrainState | None) -> Restored:
    items = {"state": ocp.args.StandardRestore(_abstract(like)), "data": ocp.args.JsonRestore(),
             "meta": ocp.args.JsonRestore()}
    if like_critic is not None:
      items["critic"] = ocp.args.StandardRestore(_abstract(like_critic))
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    critic = _from_disk(restored["critic"]) if like_critic is not None else None
    if not (finite(restored["state"]) and finite(critic)):  # written before saves were checked
      raise ValueError("its weights or optimizer state hold NaN or inf")
    return Restored(step=step, state=_from_disk(restored["state"]), critic=critic,
                    data_state=dict(restored["data"]), meta=dict(restored["meta"]))

  def failed_save(self) -> CheckpointError | None:
    """The error of a save started earlier that has already failed (a full disk), without
    waiting for one still in flight; None when none has."""
    try:
      self._manager.check_for_errors()
    except Exception as error:  # noqa: BLE001
      return self._write_failed(error)
    return None

  def wait(self) -> None:
    """Blocks until every started save is on disk."""
    progress.waiting("the checkpoint write")  # a large state on slow storage is no hang
    try:
      self._manager.wait_until_finished()
    except Exception as error:  # noqa: BLE001
      raise self._write_failed(error) from error
    progress.tick()

  def close(self) -> None:
    self.wait()
    self._manager.close()


EXIT_STOPPED = 75
"""The exit status of a run stopped by a signal (saved, or resumable from its newest
checkpoint): a scheduler requeues it, where 0 means finished."""


class StopSignal:
  """Within ``with StopSignal() as stop:``, SIGTERM and SIGINT set ``stop.requested``.

  A second signal while a stop is pending exits at once. So does the first, ``grace_s``
  seconds after it arrived, if the run has not finished its step and saved by then (a
  scheduler kills a job a fixed time after its signal): exit status ``EXIT_STOPPED``, the
  newest checkpoint on disk intact. ``grace_s=0`` waits however long the step takes.
  """

  def __init__(self, signals=(signal.SIGTERM, signal.SIGINT), say=print, grace_s: float = 0.0,
               pending: str | None = None):
    self.signals, self.requested, self.received, self.say = signals, False, None, say
    self.pending = pending
    """A stop signal that came before (during start-up, ``cli.take_stop_at_start``): taken
    as received on entry."""
    self.grace_s = grace_s
    self.agreed = False
    """Whether the job stops: set by ``agree``, the same on every process."""
    self._previous: dict[int, Any] = {}
    self._timer: threading.Timer | None = None

  def agree(self) -> bool:
    """Whether any process of the job got a stop signal, the same answer on every process (a
    collective: every process calls it at the same point of the loop). A signal that arrives
    later counts at the next call."""
    if distributed.any_process(self.requested) and not self.agreed:
      self.agreed, self.received = True, self.received or "a stop signal to another process"
    return self.agreed

  def _handle(self, signum, frame):
    name = signal.Signals(signum).name
    if self.requested:
      print(f"rlx: second stop signal ({name}): exiting now; checkpoints complete on disk are "
            "intact, rerun the same command to resume from the newest", file=sys.stderr,
            flush=True)
      os._exit(128 + signum)
    self.requested, self.received = True, name
    within = f" within {self.grace_s:.0f}s" if self.grace_s else ""
    self.say(f"rlx: {name}: stopping after this step and saving a checkpoint{within} (a second "
             "signal exits at once)")
    if self.grace_s:
      self._timer = threading.Timer(self.grace_s, self._out_of_time, args=(name,))
      self._timer.daemon = True
      self._timer.start()

  def _out_of_time(self, name: str) -> None:
    print(f"rlx: {name} came {self.grace_s:.0f}s ago (checkpoint.stop_grace_s) and the step has "
          "not finished and saved: exiting now; checkpoints complete on disk are intact, rerun "
          "the same command to resume from the newest", file=sys.stderr, flush=True)
    os._exit(EXIT_STOPPED)

  def __enter__(self):
    for sig in self.signals:
      self._previous[sig] = signal.signal(sig, self._handle)
    if self.pending:  # a start-up signal that did not end the start-up
      self.requested, self.received = True, self.pending
      self.say(f"rlx: {self.received} during start-up: stopping before training (a second "
               "signal exits at once)")
    return self

  def __exit__(self, *exc):
    if self._timer is not None:
      self._timer.cancel()
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
