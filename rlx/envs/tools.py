"""Tools: plain Python functions the model may call, their JSON schemas, and the worker
processes that run the calls.

    def calculator(expression: str) -> str:
      \"\"\"Evaluates an arithmetic expression.

      Args:
        expression: digits, + - * / and parentheses, e.g. "12*(3+4)".
      \"\"\"

    schema(calculator)   # {"type": "function", "function": {"name": "calculator", ...}}

A tool is a module-level function with type hints and a docstring (Google style: a summary,
then ``Args:``): that is what the chat template's ``tools=`` shows the model. It returns text.

``ToolRunner`` runs calls in worker processes, each call with a timeout: a tool that raises,
hangs, kills its process, runs out of memory, forks, or returns something that is not text
gives an error the model reads as the tool's answer (``ToolResult.status`` says which), and
the run goes on. Long results are cut to ``max_chars``. Workers run what the tool started
until the call returns, then kill it (as the reward workers do).
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import multiprocessing
import multiprocessing.util  # its exit handler first, so that ours runs before it
import os
import queue
import re
import resource
import signal
import sys
import threading
import time
import types
import typing
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

from rlx.rewards.functions import RewardError, _import
from rlx.rewards.pool import (_STOP_SIGNALS, _adopt_orphans, _die_with_parent,
                              _kill_descendants, _kill_tree, _start_ignoring_stop_signals)

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object",
               list: "array", type(None): "null"}
_STARTUP_S = 120.0


def _type_schema(hint: Any) -> dict:
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin is Literal:
    return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
  if origin in (typing.Union, types.UnionType):
    options = [_type_schema(a) for a in args if a is not type(None)]
    return options[0] if len(options) == 1 else {"anyOf": options}
  if origin in (list, tuple, Sequence) or hint in (list, tuple):
    return {"type": "array", **({"items": _type_schema(args[0])} if args else {})}
  if origin is dict:
    return {"type": "object"}
  if hint in _JSON_TYPES:
    return {"type": _JSON_TYPES[hint]}
  raise ValueError(f"type {hint!r} has no JSON schema; use str, int, float, bool, list or dict")


def _docstring(fn: Callable) -> tuple[str, dict[str, str]]:
  """The summary of a Google-style docstring, and its ``Args:`` descriptions."""
  text = inspect.getdoc(fn) or ""
  summary, _, rest = text.partition("\n\n")
  described: dict[str, str] = {}
  match = re.search(r"^Args:\s*\n(.*?)(?:\n\S|\Z)", text, re.S | re.M)
  if match:
    current = None
    for line in match.group(1).splitlines():
      item = re.match(r"\s+(\w+)(?:\s*\(.*?\))?:\s*(.*)", line)
      if item and (current is None or len(line) - len(line.lstrip()) <= 4):
        current = item.group(1)
        described[current] = item.group(2).strip()
      elif current and line.strip():
        described[current] += " " + line.strip()
  return " ".join(summary.split()), described


def schema(fn: Callable) -> dict:
  """The OpenAI / Hugging Face function schema of ``fn`` (from its hints and docstring).
  Raises ValueError naming what is missing."""
  name = getattr(fn, "__name__", repr(fn))
  summary, described = _docstring(fn)
  if not summary:
    raise ValueError(f"tool {name} has no docstring: the model reads it to know what the tool does")
  hints = typing.get_type_hints(fn)
  properties, required = {}, []
  for parameter in inspect.signature(fn).parameters.values():
    if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
      raise ValueError(f"tool {name}: *args and **kwargs have no schema; name each parameter")
    if parameter.name not in hints:
      raise ValueError(f"tool {name}: parameter {parameter.name!r} needs a type hint")
    properties[parameter.name] = dict(_type_schema(hints[parameter.name]))
    if parameter.name in described:
      properties[parameter.name]["description"] = described[parameter.name]
    if parameter.default is inspect.Parameter.empty:
      required.append(parameter.name)
  return {"type": "function", "function": {
      "name": name, "description": summary,
      "parameters": {"type": "object", "properties": properties, "required": required}}}


def reference(fn: Callable) -> str:
  """How a worker process imports ``fn``: 'package.module:name', or 'path/file.py:name' for a
  function from a file. Raises ValueError for what a worker cannot import (a lambda, a
  closure, a method)."""
  name = getattr(fn, "__qualname__", "")
  if not inspect.isfunction(fn) or "<" in name or "." in name:
    raise ValueError(f"tool {fn!r} must be a module-level function (worker processes import "
                     "it by name)")
  module = sys.modules.get(fn.__module__)
  path = getattr(module, "__file__", None)
  if fn.__module__.startswith("rlx_user_reward_") or fn.__module__ == "__main__":
    if not path:
      raise ValueError(f"tool {name} lives in a module with no file; put it in a .py file")
    return f"{path}:{name}"
  return f"{fn.__module__}:{name}"


@dataclasses.dataclass(frozen=True)
class ToolResult:
  """What one call gave the model to read, and how it went."""

  text: str
  status: Literal["ok", "error", "timeout"]
  seconds: float
  """How long the call ran (from when a worker took it)."""
  waited: float = 0.0
  """How long it waited for a free worker before that (all ``num_workers`` busy)."""


def _cut(text: str, max_chars: int) -> str:
  if len(text) <= max_chars:
    return text
  return text[:max_chars] + f"... [cut: {len(text) - max_chars} more characters]"


def _invoke(ref: str, arguments: dict, max_chars: int) -> tuple[str, str]:
  """("ok", text) or ("error", message) of one call, in this process."""
  try:
    fn = _import(ref)
  except RewardError as error:
    return "error", str(error).replace("reward ", "tool ", 1)
  try:
    result = fn(**arguments)
  except BaseException as error:  # noqa: BLE001 - any failure (exit too) is the model's to read
    return "error", f"{type(error).__name__}: {error}"
  if not isinstance(result, str):
    return "error", f"the tool returned a {type(result).__name__}, not text"
  return "ok", _cut(result, max_chars)


def _serve(connection, memory_mb: int) -> None:
  """A tool worker's loop: (ref, arguments, max_chars) in, (status, text) out."""
  for sig in _STOP_SIGNALS:
    signal.signal(sig, signal.SIG_IGN)
  _die_with_parent()
  _adopt_orphans()
  devnull = os.open(os.devnull, os.O_WRONLY)  # what tools print goes nowhere
  os.dup2(devnull, 1)
  os.dup2(devnull, 2)
  if memory_mb:
    limit = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  connection.send(("ready", ""))
  me = os.getpid()
  while True:
    try:
      task = connection.recv()
    except (EOFError, OSError):
      return
    if task is None:
      _kill_descendants()
      return
    call, *work = task
    reply = _invoke(*work)
    if os.getpid() != me:  # a copy the tool forked, returning from it: it never answers
      os._exit(0)
    _kill_descendants()
    try:
      connection.send((call, *reply))
    except (OSError, ValueError):
      return


class _Worker:
  def __init__(self, context, memory_mb: int):
    self.connection, child = context.Pipe()
    self.process = context.Process(target=_serve, args=(child, memory_mb), daemon=True,
                                   name="rlx-tool-worker")
    _start_ignoring_stop_signals(self.process)
    child.close()
    self.ready = False

  def wait_ready(self) -> bool:
    if not self.ready and self.connection.poll(_STARTUP_S):
      try:
        self.ready = self.connection.recv()[0] == "ready"
      except (EOFError, OSError):
        return False
    return self.ready

  def kill(self) -> None:
    """Kills the worker and every process its calls started, those that left its process
    group (``setsid``) too: found as its descendants before it dies, not after, when they
    would belong to init."""
    try:
      _kill_tree(self.process.pid)
    except (OSError, TypeError):  # never started
      self.process.kill()
    self.process.join(timeout=5)
    self.connection.close()


_RUNNERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _kill_workers_at_exit() -> None:
  """Kills the workers of every runner still open when the interpreter exits. They ignore
  SIGTERM (a Ctrl-C must not kill them mid-call), so multiprocessing's own exit handler, which
  terminates daemonic children with SIGTERM and then joins them, would wait for them forever:
  a run that failed without closing its runner never exited. Registered after that handler,
  so it runs before it."""
  for runner in list(_RUNNERS):
    runner.close(wait_s=0)


class ToolRunner:
  """Runs tool calls in ``num_workers`` processes, each call with ``timeout_s`` (0 workers:
  in the calling thread, no timeout, for debugging). Safe to share between threads: a call
  takes a worker for itself and gives it back."""

  def __init__(self, *, num_workers: int = 2, timeout_s: float = 5.0, memory_mb: int = 2048,
               max_chars: int = 2000):
    self.num_workers, self.timeout_s = num_workers, timeout_s
    self.memory_mb, self.max_chars = memory_mb, max_chars
    self._context = multiprocessing.get_context("spawn")
    self._idle: queue.Queue[_Worker] = queue.Queue()
    self._closed = False
    self._lock = threading.Lock()
    self._calls = 0  # numbers each call: its answer must carry it
    self._busy: set[_Worker] = set()  # taken by a call: killed, not waited for, on close
    for _ in range(num_workers):
      self._idle.put(_Worker(self._context, memory_mb))
    _RUNNERS.add(self)

  def call(self, ref: str, arguments: dict) -> ToolResult:
    """Runs ``ref(**arguments)``; never raises for what the tool does."""
    started = time.monotonic()
    if not self.num_workers:
      status, text = _invoke(ref, arguments, self.max_chars)
      return ToolResult(text, status, time.monotonic() - started)
    worker = self._idle.get()
    self._busy.add(worker)
    waited = time.monotonic() - started
    try:
      if not worker.wait_ready():
        raise EOFError
      started = time.monotonic()
      with self._lock:
        self._calls += 1
        call = self._calls
      worker.connection.send((call, ref, arguments, self.max_chars))
      while True:  # only this call's answer: anything else on the pipe is not its result
        left = self.timeout_s - (time.monotonic() - started)
        if left <= 0 or not worker.connection.poll(left):
          worker = self._replace(worker)
          return ToolResult(f"the tool ran past its {self.timeout_s:g}s limit and was stopped",
                            "timeout", time.monotonic() - started, waited)
        answered, status, text = worker.connection.recv()
        if answered == call:
          return ToolResult(text, status, time.monotonic() - started, waited)
    except (EOFError, OSError, ValueError):  # it died: killed itself, or out of memory
      code = worker.process.exitcode
      worker = self._replace(worker)
      return ToolResult(f"the tool's process died (exit code {code})", "error",
                        time.monotonic() - started, waited)
    finally:
      self._busy.discard(worker)
      if self._closed:
        worker.kill()
      else:
        self._idle.put(worker)

  def _replace(self, worker: _Worker) -> _Worker:
    """Kills ``worker`` (hung, or dead) and starts its successor, unless the runner is closed."""
    worker.kill()
    return worker if self._closed else _Worker(self._context, self.memory_mb)

  def close(self, wait_s: float = 2.0) -> None:
    """Stops the workers: idle ones are asked to exit and given ``wait_s`` seconds, then
    killed; those in a call are killed (their call returns an error)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    _RUNNERS.discard(self)
    for worker in list(self._busy):
      worker.kill()
    while True:
      try:
        worker = self._idle.get_nowait()
      except queue.Empty:
        return
      try:
        worker.connection.send(None)
      except (OSError, ValueError):
        pass
      worker.process.join(timeout=wait_s)
      if worker.process.is_alive():
        worker.kill()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
