"""Compile once per machine: JAX's persistent compilation cache, the time this process
spent compiling (or loading compiled programs from the cache), and a line while a long
compile runs (``report_progress``), so that a start that compiles for minutes says so."""

from __future__ import annotations

import logging
import pathlib
import threading
import time
from collections.abc import Callable

_lock = threading.Lock()
_totals = {"seconds": 0.0, "programs": 0, "from_cache": 0}
_listening = False
_directory: pathlib.Path | None = None
_compiling: tuple[str, float] | None = None  # the program being compiled, since when
_finished_at = 0.0  # time.time() when the last compile (or load from the cache) ended


def _on_duration(event: str, duration: float, **_) -> None:
  global _compiling, _finished_at
  if event == "/jax/core/compile/backend_compile_duration":
    with _lock:
      _totals["seconds"] += duration
      _totals["programs"] += 1
      _compiling, _finished_at = None, time.time()


class _Compiles(logging.Filter):
  """On JAX's lowering logger: notes the name of each program it starts compiling (a debug
  record it would not print), and drops its debug records, so that nothing more is printed
  than before."""

  def filter(self, record: logging.LogRecord) -> bool:
    global _compiling
    if record.levelno > logging.DEBUG:
      return True
    if str(record.msg).startswith("Compiling %s") and record.args:
      with _lock:
        _compiling = (str(record.args[0]), time.monotonic())
    return False


def compiling() -> str | None:
  """The name of the program being compiled now (None: no compile in flight; seen once
  ``report_progress`` has started watching)."""
  with _lock:
    return None if _compiling is None else _compiling[0]


def finished_at() -> float:
  """``time.time()`` when the last compile (or load from the cache) ended; 0 before any."""
  with _lock:
    return _finished_at


def report_progress(say: Callable[[str], None], after_s: float = 10.0,
                    every_s: float = 15.0) -> None:
  """From now on, a compile that runs past ``after_s`` seconds says which program it is and
  how many were compiled before it, every ``every_s`` seconds (from a daemon thread)."""
  lowering = logging.getLogger("jax._src.interpreters.pxla")
  if not any(isinstance(f, _Compiles) for f in lowering.filters):
    lowering.addFilter(_Compiles())
    if lowering.getEffectiveLevel() > logging.DEBUG:
      lowering.setLevel(logging.DEBUG)

  def watch() -> None:
    told = None
    while True:
      time.sleep(1.0)
      with _lock:
        current, done = _compiling, _totals["programs"]
      if current is None or time.monotonic() - current[1] < after_s:
        continue
      if told is not None and told[0] == current and time.monotonic() - told[1] < every_s:
        continue
      told = (current, time.monotonic())
      say(f"rlx: compiling {current[0]} ({time.monotonic() - current[1]:.0f}s so far; {done} "
          "programs compiled before it)")

  threading.Thread(target=watch, name="rlx-compile-progress", daemon=True).start()


def _on_event(event: str, **_) -> None:
  global _compiling, _finished_at
  if event == "/jax/compilation_cache/cache_hits":
    with _lock:
      _totals["from_cache"] += 1
      _compiling, _finished_at = None, time.time()  # loaded, not compiled


def start(cache_dir: str) -> pathlib.Path | None:
  """Counts compilations from now on and, unless ``cache_dir`` is empty, keeps every compiled
  program in ``cache_dir`` so that the next run of the same programs loads them instead.
  Returns the cache directory (None when off)."""
  global _listening
  import jax

  if not _listening:
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)
    _listening = True
  global _directory
  if not cache_dir:
    _directory = None
    return None
  directory = _directory = pathlib.Path(cache_dir).expanduser()
  directory.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(directory))
  # Every program, however quick to compile: a run compiles dozens of small ones.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return directory


def directory() -> pathlib.Path | None:
  """The cache directory ``start`` set, or None when the cache is off."""
  return _directory


def totals() -> dict[str, float]:
  """Seconds spent compiling or loading from the cache, programs, and how many came from it."""
  with _lock:
    return dict(_totals)
