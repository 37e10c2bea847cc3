"""The one metrics sink of a run: console progress, ``WORKDIR/metrics.jsonl`` and TensorBoard.

    with MetricsSink(workdir, config.logging, total_steps=config.trainer.steps) as sink:
        sink.write(step, {"reward/mean": 0.4, "policy/kl": 0.01, ...})

Jitted code returns flat dicts of scalars; only the trainer writes them here.
Values may be Python or NumPy / JAX scalars. On resume from step k, lines of
``metrics.jsonl`` past k (written after the checkpoint, before the stop) are
dropped, and a fresh start (no checkpoint) drops them all, so the file reads as
one uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import pathlib
import time
from collections.abc import Mapping
from typing import Any

from rlx.config import LoggingConfig

# Shown on the console, in this order, when present.
CONSOLE_KEYS = ("reward/mean", "reward/accuracy", "eval/accuracy", "policy/kl",
                "policy/kl_behaviour", "policy/clip_frac_high", "policy/entropy",
                "agent/turns_mean", "agent/tool_calls_mean", "rollout/policy_lag_max",
                "throughput/tokens_per_s", "time/step_s")


def _scalar(value: Any) -> float | int:
  value = value.item() if hasattr(value, "item") else value
  if isinstance(value, bool):
    return int(value)
  if not isinstance(value, (int, float)):
    raise TypeError(f"metrics must be scalars, got {type(value).__name__}")
  return value


def _wandb_run(project: str, workdir: pathlib.Path, name: str, run_config: dict | None):
  """A Weights & Biases run for the workdir (a resumed run continues the same one), or None
  with one warning line when wandb is missing or cannot start (no login, no network)."""
  try:
    import wandb  # noqa: PLC0415 - an optional dependency
  except ImportError:
    print("rlx: warning: logging.wandb_project is set but wandb is not installed (pip install "
          "'rlx[wandb]'); metrics go to metrics.jsonl and TensorBoard only", flush=True)
    return None
  run_id = hashlib.sha1(str(workdir.resolve()).encode()).hexdigest()[:12]
  try:
    return wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(workdir),
                      config=run_config or {})
  except Exception as error:  # noqa: BLE001 - a login or network problem never stops a run
    print(f"rlx: warning: Weights & Biases did not start ({type(error).__name__}: "
          f"{str(error)[:200]}); metrics go to metrics.jsonl and TensorBoard only (WANDB_MODE="
          "offline logs locally for a later `wandb sync`)", flush=True)
    return None


def progress_bar(console=None):
  """A rich progress display of two lines: ``rlx [bar] step/total  s/step  ETA`` (always whole,
  at any terminal width), and under it the task's description (the step's metrics), cut to
  the width."""
  from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                             TimeRemainingColumn)
  from rich.text import Text

  class SecondsPerStep(ProgressColumn):
    def render(self, task):
      return Text(f"{1 / task.speed:.2f} s/step" if task.speed else "– s/step")

  class TwoLines(Progress):
    def get_renderables(self):
      yield self.make_tasks_table(self.tasks)
      for task in self.tasks:
        if task.description:
          yield Text(f"  {task.description}", no_wrap=True, overflow="ellipsis")

  return TwoLines(TextColumn("[bold]rlx"), BarColumn(bar_width=None), MofNCompleteColumn(),
                  SecondsPerStep(), TimeRemainingColumn(), console=console, expand=True)


def _summary_writer():
  """tensorboardX's ``SummaryWriter``, imported without torch where torch is not loaded yet:
  tensorboardX imports it, when installed, only to take its tensors (rlx writes floats), and
  that import alone is 190 MB of the process's memory for the whole run."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None  # an import of it fails, and tensorboardX goes on without it
  try:
    from tensorboardX import SummaryWriter
  finally:
    del sys.modules["torch"]
  return SummaryWriter


class MetricsSink:
  """Writes each step's metrics to the console, a JSONL file and TensorBoard event files."""

  def __init__(self, workdir: str | pathlib.Path, config: LoggingConfig = LoggingConfig(), *,
               total_steps: int | None = None, resume_step: int | None = None,
               write: bool = True, run_name: str = "rlx", run_config: dict | None = None):
    self.config, self.total_steps, self.write_files = config, total_steps, write
    workdir = pathlib.Path(workdir)
    self.jsonl_path = workdir / "metrics.jsonl"
    self._jsonl = self._tensorboard = self._progress = self._wandb = None
    if not write:  # other processes of a multi-host run keep quiet
      return
    workdir.mkdir(parents=True, exist_ok=True)
    if config.jsonl:
      if self.jsonl_path.exists():
        self._truncate(resume_step or 0)
      self._jsonl = open(self.jsonl_path, "a")
    if config.tensorboard:
      self._tensorboard = _summary_writer()(str(workdir / "tb"), purge_step=(resume_step or 0) + 1)
    if config.wandb_project:
      self._wandb = _wandb_run(config.wandb_project, workdir, run_name, run_config)
    if config.progress_bar and sys.stdout.isatty():  # else a plain line per written step
      self._progress = progress_bar()
      self._task = self._progress.add_task("", total=total_steps, completed=resume_step or 0)
      self._progress.start()

  def _truncate(self, resume_step: int) -> None:
    """Drops the lines past ``resume_step`` (steps the checkpoint does not hold: they will be
    trained again), and a torn last line; written to a new file, then renamed."""
    kept = []
    for line in self.jsonl_path.read_text().splitlines():
      try:
        if json.loads(line)["step"] <= resume_step:
          kept.append(line)
      except (json.JSONDecodeError, KeyError, TypeError):  # a line cut short by a kill
        continue
    partial = self.jsonl_path.with_name(self.jsonl_path.name + ".partial")
    partial.write_text("".join(line + "\n" for line in kept))
    partial.replace(self.jsonl_path)

  def write(self, step: int, metrics: Mapping[str, Any], force: bool = False
            ) -> dict[str, float | int]:
    """Records one step (``force``: even off the ``logging.every_steps`` schedule: the last
    one); returns the metrics as Python scalars."""
    values = {key: _scalar(value) for key, value in sorted(metrics.items())}
    if not self.write_files or (step % self.config.every_steps and not force):
      return values
    if self._jsonl is not None:
      record = {"step": step, "time/timestamp": round(time.time(), 3),  # for plots by wall clock
                **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                   for k, v in values.items()}}
      self._jsonl.write(json.dumps(record) + "\n")
      self._jsonl.flush()
    if self._tensorboard is not None:
      for key, value in values.items():
        self._tensorboard.add_scalar(key, value, step)
    if self._wandb is not None:
      try:
        self._wandb.log(values, step=step)
      except Exception as error:  # noqa: BLE001 - a logging service never stops a run
        print(f"rlx: warning: Weights & Biases logging stopped ({type(error).__name__}: "
              f"{str(error)[:200]}); metrics.jsonl and TensorBoard go on", flush=True)
        self._wandb = None
    summary = "  ".join(f"{k} {values[k]:.4g}" for k in CONSOLE_KEYS if k in values)
    if self._progress is not None:
      self._progress.update(self._task, completed=step, description=summary)
    elif summary:
      print(f"rlx: step {step}: {summary}", flush=True)
    return values

  def close(self) -> None:
    if self._wandb is not None:
      try:
        self._wandb.finish()
      except Exception:  # noqa: BLE001
        pass
      self._wandb = None
    if self._progress is not None:
      self._progress.stop()
      self._progress = None
    if self._tensorboard is not None:
      self._tensorboard.close()
      self._tensorboard = None
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class ProfileWindow:
  """Traces the training steps of ``logging.profile_steps`` with ``jax.profiler``: call
  ``at(step)`` before each step with the number of steps done; the trace starts at the
  window's first step and stops after its last (or when the loop ends, on ``close``)."""

  def __init__(self, config: LoggingConfig, directory: pathlib.Path, process: int = 0,
               say=print):
    self.window = config.profile_window
    self.directory = pathlib.Path(directory) / f"process_{process}"
    self.say = say
    self.tracing = False

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def at(self, step: int) -> None:
    if self.window is None:
      return
    import jax

    first, end = self.window
    if not self.tracing and first <= step < end:
      jax.profiler.start_trace(str(self.directory))
      self.tracing = True
    elif self.tracing and step >= end:
      self.close()

  def close(self) -> None:
    if self.tracing:
      import jax

      jax.profiler.stop_trace()
      self.tracing = False
      self.say(f"rlx: profile of steps {self.window[0]}..{self.window[1] - 1} written to "
               f"{self.directory}")


class BusyWindow:
  """Busy fractions over the last ``window`` steps, from cumulative busy seconds: what each
  side is doing now, where the cumulative fraction since the start only drifts."""

  def __init__(self, window: int = 10):
    self.window = window
    self._history: list[tuple[float, dict[str, float]]] = []

  def update(self, wall: float, busy: Mapping[str, float]) -> dict[str, float]:
    """``wall``: seconds since the loop started; ``busy``: {metric name: cumulative busy
    seconds}. Returns {metric name: busy fraction over the window}."""
    self._history.append((wall, dict(busy)))
    self._history = self._history[-(self.window + 1):]
    then, before = self._history[0] if len(self._history) > 1 else (0.0, dict.fromkeys(busy, 0.0))
    span = max(wall - then, 1e-9)
    return {name: min(max((seconds - before.get(name, 0.0)) / span, 0.0), 1.0)
            for name, seconds in busy.items()}

