"""Compile once per machine: JAX's persistent compilation cache, and the time this process
spent compiling (or loading compiled programs from the cache)."""

from __future__ import annotations

import pathlib
import threading

_lock = threading.Lock()
_totals = {"seconds": 0.0, "programs": 0, "from_cache": 0}
_listening = False
_directory: pathlib.Path | None = None


def _on_duration(event: str, duration: float, **_) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    with _lock:
      _totals["seconds"] += duration
      _totals["programs"] += 1


def _on_event(event: str, **_) -> None:
  if event == "/jax/compilation_cache/cache_hits":
    with _lock:
      _totals["from_cache"] += 1


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
