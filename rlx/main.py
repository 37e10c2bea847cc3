"""Entry point: ``python -m rlx.main --config configs/X.py --workdir DIR [--config.a.b=value ...]``.

Validates the config, writes ``DIR/config.json``, starts JAX (fake CPU devices
on a CPU machine, the multi-process runtime when ``mesh.multihost``), and runs
the loop of ``mesh.mode`` (colocated or split); a workdir with a checkpoint
resumes. At the end it prints the held-out accuracy before and after RL and
where the metrics and checkpoints are. ``kill -USR1 PID`` prints every thread's stack to
stderr (what a run that seems stuck is doing) and lets it go on. Every process the run starts
(an environment's, a reward's, a tool's, in any session) ends when it ends, by any path, a
SIGKILL included (``rlx.reaper``).
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import os
import pathlib
import signal
import sys
import threading
import time
import traceback

from rlx import cli, progress
from rlx.config import ConfigError, RunConfig
from rlx.hostmem import HeapTrimmer, return_freed_memory

"""Stopped by a signal after saving a checkpoint: rerun the same command to resume (EX_TEMPFAIL;
a scheduler requeues on it). Finished is 0, a failed run 1, a refused config, checkpoint or
reward 2, interrupted before training 130."""


def write_config(config: RunConfig, workdir: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path | None]:
  """Writes the resolved config to ``workdir/config.json``; keeps a different earlier one aside.
  Returns the path and where the earlier one went (None: there was none, or the same)."""
  workdir.mkdir(parents=True, exist_ok=True)
  path = workdir / "config.json"
  text = cli.to_json(config)
  previous = None
  if path.is_file() and path.read_text() != text:
    stamp = time.strftime('%Y%m%d-%H%M%S')
    previous, n = workdir / f"config.{stamp}.json", 1
    while previous.exists():  # two starts in one second: keep both
      previous, n = workdir / f"config.{stamp}-{n}.json", n + 1
    path.rename(previous)
    print(f"rlx: {path} held a different config; kept it as {previous.name}")
  path.write_text(text)
  return path, previous


COLLECTIVE_PATIENCE_S = 180
"""How long an XLA:CPU collective waits for its other devices before XLA ends the process (XLA's
own default, 40 s, aborted runs on a loaded 2-core machine, where one device's share of a program
can reach the all-reduce that much later than the other's); a collective that waits 60 s says so.
Three minutes, not more: a collective that waits that long is a hang, not a slow device (rlx's
programs keep no collective in a loop beside an independent one, ``rlx.hlo_order``), and the
run should end with its last checkpoint kept rather than sit for ten minutes."""


def patient_collectives(environ=os.environ) -> None:
  """Raises XLA:CPU's collective timeouts to COLLECTIVE_PATIENCE_S (warning after 60 s), unless
  XLA_FLAGS already sets them; before the backend starts, when XLA reads its flags."""
  flags = environ.get("XLA_FLAGS", "")
  for name, seconds in (("xla_cpu_collective_call_terminate_timeout_seconds",
                         COLLECTIVE_PATIENCE_S),
                        ("xla_cpu_collective_call_warn_stuck_timeout_seconds", 60)):
    if f"--{name}=" not in flags:
      flags = f"{flags} --{name}={seconds}".strip()
  environ["XLA_FLAGS"] = flags


def start_jax(config: RunConfig):
  """Imports and configures JAX: CPU device count, patient CPU collectives, and the
  multi-process runtime if asked."""
  patient_collectives()
  import jax

  try:
    jax.config.update("jax_num_cpu_devices", config.mesh.cpu_devices)
  except RuntimeError:  # JAX already started in this process: keep the devices it has
    print(f"rlx: JAX was already running; config.mesh.cpu_devices={config.mesh.cpu_devices} "
          "not applied")
  cache = config.trainer.compile_cache
  if config.mesh.multihost:
    from rlx import distributed

    distributed.initialize()
    if distributed.cpu_only() and cache:
      # JAX writes the cache from process 0 and every process reads it; a process that ran
      # XLA:CPU executables loaded from it took the wrong side of gloo collectives, and the
      # job aborted ("Received data size doesn't match expected size") on every warm rerun
      if distributed.lead():
        print("rlx: trainer.compile_cache is off for a multi-process CPU job (programs loaded "
              "from it run mismatched gloo collectives); every process compiles")
      cache = ""
  from rlx import compilation

  compilation.start(cache)
  if jax.process_index() == 0:
    compilation.report_progress(lambda line: print(line, flush=True))
  return jax


def _percent(value: float | None) -> str:
  return "n/a" if value is None else f"{value:.1%}"


def run(config: RunConfig, workdir: pathlib.Path) -> int:
  """Trains (or resumes) the run ``config`` describes, in ``workdir``."""
  jax = start_jax(config)  # after parsing, so that a bad command line never waits for JAX
  from rlx import trainer
  from rlx.trainer import CheckpointError

  lead = jax.process_index() == 0
  say = (lambda message: print(message, flush=True)) if lead else (lambda message: None)
  previous = None
  if lead and config.mesh.role != "generator":  # a generator job shares its learner's workdir
    written, previous = write_config(config, workdir)
    say(f"rlx: run {config.name!r}: resolved config written to {written}")
  say(f"rlx: {jax.device_count()} {jax.default_backend()} devices in {jax.process_count()} "
      f"process(es), mode={config.mesh.mode}"
      + ("" if config.mesh.role == "both" else f" ({config.mesh.role} job)")
      + f", algorithm={config.algorithm.name} "
      f"(advantage {config.algorithm.advantage_estimator}, loss {config.algorithm.loss}), "
      f"model={config.model.path or 'built-in ' + config.model.arch.family}")
  pinned = config.algorithm.pinned_over_preset()
  if pinned:
    say(f"rlx: the config pins {', '.join(pinned)}: these win over the {config.algorithm.name} "
        "preset (set them to auto / None to take the preset's)")
  started = time.perf_counter()
  status = None
  if config.mesh.role != "both" and lead:  # its peers watch this job's status file
    from rlx.trainer.deploy.jobstatus import JobStatus

    job = config.mesh.generator_id if config.mesh.role == "generator" else 0
    status = JobStatus(workdir, config.mesh.role, job)
  from rlx.trainer import EXIT_STOPPED

  # a multi-device CPU mesh: a program stuck at a collective ends the run before XLA's abort
  programs_s = (COLLECTIVE_PATIENCE_S - 30
                if jax.default_backend() == "cpu" and jax.local_device_count() > 1 else 0)
  with status or contextlib.nullcontext(), progress.Watchdog(config.trainer.hang_timeout_s,
                                                             programs_s=programs_s):
    try:
      summary = trainer.train(config, workdir, say)
    except CheckpointError:
      if previous is not None:  # refused: the config the checkpoints belong to stays the run's
        previous.replace(workdir / "config.json")
      raise
    if status:
      status.stopped = summary.stopped
  minutes = (time.perf_counter() - started) / 60
  if config.mesh.role == "generator":
    say(f"rlx: generator job: {summary.written} rollout file(s) in {minutes:.1f} min"
        + (" (stopped; rerun the same command to resume)" if summary.stopped else ""))
    return EXIT_STOPPED if summary.stopped else 0
  first = summary.first_step  # this process's steps, after a resume
  if not first:
    ran = f"{summary.steps} steps"
  elif summary.steps > first:
    ran = (f"steps {first + 1}..{summary.steps} ({summary.steps - first} after resuming at "
           f"step {first})")
  else:
    ran = f"no step after resuming at step {first}"
  say(f"rlx: {ran} in {minutes:.1f} min"
      + (" (stopped early; rerun the same command to resume)" if summary.stopped else ""))
  seconds = summary.seconds
  say(f"rlx: time: start-up {seconds['start-up']:.0f}s, warm-up {seconds['warm-up']:.0f}s, "
      f"RL loop {seconds['RL loop']:.0f}s, held-out evals {seconds['evals']:.0f}s")
  from rlx import compilation

  compiled = compilation.totals()
  cache = compilation.directory()
  say(f"rlx: compiling: {compiled['seconds']:.0f}s for {compiled['programs']} programs"
      + (f", {compiled['from_cache']} of them loaded from the cache in {cache}" if cache
         else " (trainer.compile_cache is off)"))
  if summary.eval_accuracy_after is not None:
    before, after = summary.eval_accuracy_before, summary.eval_accuracy_after
    change = "" if before is None else f" ({100 * (after - before):+.1f} points)"
    say(f"rlx: held-out accuracy: before RL {_percent(before)}, after RL {_percent(after)}{change}")
  say(f"rlx: metrics:     {summary.metrics} (TensorBoard: {workdir / 'tb'})")
  say(f"rlx: checkpoints: {summary.checkpoints}")
  return EXIT_STOPPED if summary.stopped else 0


_MACHINE_ERRORS = {
    errno.ENOSPC: "Free space there, or point --workdir at a disk with room",
    errno.EDQUOT: "The disk quota is used up: free some of it, or point --workdir elsewhere",
    errno.EROFS: "That file system is read-only: point --workdir at a writable one",
    errno.EACCES: "This user may not write there: point --workdir at a directory it owns",
}


_stopped_at_start = False
"""Set when a start-up was stopped: JAX's threads may be mid-work, and the interpreter's
teardown can abort on them, so the command exits without it (nothing is left to save)."""


def _stop_at_start(signum, frame) -> None:
  # recorded first: the exception below can be swallowed where it lands (a garbage-collector
  # callback, an import), and the training loop then stops before it trains instead
  cli.stop_at_start("SIGINT" if signum == signal.SIGINT else "SIGTERM")
  raise KeyboardInterrupt if signum == signal.SIGINT else cli.StoppedAtStart


def _quiet_unraisable(unraisable) -> None:
  """``sys.unraisablehook`` during start-up: the stop exception of ``_stop_at_start`` that
  landed where Python cannot raise it (a garbage-collector callback) is dropped without the
  "Exception ignored ... Traceback" it would print: the signal is recorded, and the training
  loop stops before it trains and says so. Anything else goes to the usual hook."""
  ours = isinstance(unraisable.exc_value, (cli.StoppedAtStart, KeyboardInterrupt))
  if not (ours and cli.stopped_at_start()):
    _unraisable_before(unraisable)


_unraisable_before = sys.__unraisablehook__


ERROR_LOG = "error.log"
"""Where in the workdir a run that ended on an error keeps its traceback."""


def _keep_traceback(invocation) -> None:
  """Writes the error being handled, with its traceback, to the workdir's ``error.log`` and
  says where: the one-line message is for the user, the traceback for a bug report (an error
  no refusal meant, such as an empty ``max()``, would be lost otherwise)."""
  if invocation is None or not pathlib.Path(invocation.workdir).is_dir():
    return
  path = pathlib.Path(invocation.workdir) / ERROR_LOG
  try:
    path.write_text(traceback.format_exc())
  except OSError:
    return
  print(f"rlx: the traceback is in {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
  return_freed_memory()
  with HeapTrimmer():  # a checkpoint's freed buffers, among others, leave the process
    return _main_with_handlers(argv)


def _main_with_handlers(argv: list[str] | None) -> int:
  previous = {}
  if threading.current_thread() is threading.main_thread():
    # until the loop's own handler (save, then stop): a scheduler's SIGTERM during start-up
    # ends the run with one line and the requeue status, not a bare -15; a Ctrl-C, with 130
    previous = {sig: signal.signal(sig, _stop_at_start) for sig in (signal.SIGTERM,
                                                                     signal.SIGINT)}
  global _unraisable_before
  _unraisable_before, sys.unraisablehook = sys.unraisablehook, _quiet_unraisable
  try:
    return _main(argv)
  finally:
    sys.unraisablehook = _unraisable_before
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def _main(argv: list[str] | None) -> int:
  invocation = None
  try:
    invocation = cli.parse_args(sys.argv[1:] if argv is None else argv)
    if invocation is None:
      return 0
    return run(invocation.config, invocation.workdir)
  except ConfigError as error:
    return cli.main_error(error)
  except KeyboardInterrupt:  # before the training loop took over the stop signals
    print("rlx: interrupted before training started; nothing to save", file=sys.stderr)
    return 130
  except cli.StoppedAtStart:
    print("rlx: SIGTERM before training started: nothing to save; rerun the same command to "
          "start", file=sys.stderr)
    global _stopped_at_start
    _stopped_at_start = True
    return os.EX_TEMPFAIL  # 75, rlx.checkpoint.EXIT_STOPPED: a scheduler requeues it
  except ValueError as error:  # CheckpointError and other refusals with a message for the user
    print(f"rlx: error: {error}", file=sys.stderr)
    _keep_traceback(invocation)
    return 2
  except OSError as error:  # the machine refused: a full disk, a read-only or forbidden path
    if error.errno not in _MACHINE_ERRORS:
      raise
    where = (f" ({error.filename})" if error.filename else
             f" (under --workdir {invocation.workdir})" if invocation else "")
    print(f"rlx: error: {error.strerror}{where}. "
          + _MACHINE_ERRORS[error.errno] + "; checkpoints already written are kept, and "
          "rerunning the same command resumes from the newest", file=sys.stderr)
    return 2
  except RuntimeError as error:  # the run failed (e.g. dynamic sampling ran dry); checkpoints stay
    from rlx.trainer import TrainingError

    if not isinstance(error, TrainingError):
      raise
    print(f"rlx: error: {error}", file=sys.stderr)
    from rlx.trainer.common import RewardFailedError

    return 2 if isinstance(error, RewardFailedError) else 1


if __name__ == "__main__":
  if hasattr(signal, "SIGUSR1"):  # every thread's stack on demand, the run going on
    faulthandler.register(signal.SIGUSR1, all_threads=True)
  from rlx import reaper

  reaper.start()  # whatever the run starts ends with it, however it ends
  status = main()
  if _stopped_at_start:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
  sys.exit(status)
