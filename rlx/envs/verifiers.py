"""``verifiers`` environments as rlx agent programs, with one config line.

    --config.env.agent=verifiers:my_taskset

names a ``verifiers`` taskset by the id its own tools take (an installed package or module
that exports a ``Taskset`` subclass, and optionally its own ``Harness``). Needs
``pip install 'rlx[verifiers]'``.

- The run's prompts are the taskset's tasks: row ``i`` is task ``i`` (its prompt text shown in
  samples and reports), and ``data.source`` is left at its default. Held-out evaluation takes
  ``data.eval_fraction`` of the tasks, as for a data file.
- Each episode is one ``Env.run_episode`` of the row's task: the environment's harness drives
  the conversation, its model calls reach the run's OpenAI-compatible endpoint (through the
  interception proxy ``verifiers`` puts in front of every harness), and the endpoint records
  every sampled token under the episode's key (the ``X-Episode-Id`` header).
- The episode's reward is the mean over its traces of each trace's weighted reward (a
  single-agent environment has one trace), correct when it is at least 1. An episode that
  ``verifiers`` reports as failed (an error in setup, the harness, scoring, or its own
  timeout) is a failed program: counted, and its group is dropped.
- ``env.verifiers_config`` is JSON for the rest of the environment's config
  (``SingleAgentEnvConfig``: ``agent.harness``, ``agent.runtime``, ``timeout``, ``taskset``
  options); the runtime defaults to a local subprocess, where the run itself is.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import weakref

PREFIX = "verifiers:"
_HEADER = "X-Episode-Id"
_KEY_VARIABLE = "RLX_VERIFIERS_API_KEY"  # verifiers reads API keys from the environment

_lock = threading.Lock()
_loaded: dict[tuple[str, str], tuple[object, list]] = {}


def taskset_id(agent: str) -> str | None:
  """The taskset an ``env.agent`` value names (``'verifiers:TASKSET_ID'``), else None."""
  return agent.removeprefix(PREFIX).strip() if agent.startswith(PREFIX) else None


def _import():
  try:
    import verifiers.v1 as vf  # noqa: PLC0415 - an optional dependency, imported when used
  except ImportError as error:
    raise ValueError(f"verifiers environments need the verifiers package ({error}): "
                     "pip install 'rlx[verifiers]'") from None
  return vf


def _config(taskset: str, options: str):
  """The environment's ``SingleAgentEnvConfig``: ``options`` (JSON) over a local runtime."""
  vf = _import()
  try:
    fields = json.loads(options or "{}")
  except json.JSONDecodeError as error:
    raise ValueError(f"env.verifiers_config is not JSON ({error})") from None
  if not isinstance(fields, dict):
    raise ValueError(f"env.verifiers_config must be a JSON object, got {options!r}")
  fields.setdefault("agent", {}).setdefault("runtime", {"type": "subprocess"})
  fields["taskset"] = dict(fields.get("taskset") or {}, id=taskset)
  try:
    return vf.SingleAgentEnvConfig(**fields)
  except ModuleNotFoundError as error:
    raise ValueError(f"verifiers taskset {taskset!r}: {error}") from None
  except Exception as error:  # noqa: BLE001 - pydantic's message names the field
    raise ValueError(f"env.verifiers_config: {error}") from None


def environment(taskset: str, options: str = "") -> tuple[object, list]:
  """The ``verifiers`` environment of a taskset id and its tasks, loaded once per process."""
  if not taskset:
    raise ValueError(f"name the taskset: env.agent='{PREFIX}TASKSET_ID'")
  if "." in taskset.rsplit("/", 1)[-1].split("@", 1)[0]:
    raise ValueError(f"verifiers taskset {taskset!r}: verifiers imports a taskset by the name of "
                     "a top-level module (an installed package, or a module on PYTHONPATH), "
                     "not a dotted path")
  key = (taskset, options)
  with _lock:
    if key not in _loaded:
      config = _config(taskset, options)  # its errors first, as ValueErrors
      from verifiers.v1.utils.loaders import load_environment  # noqa: PLC0415

      try:
        env = load_environment(config)
      except (ImportError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"verifiers taskset {taskset!r}: {error}") from None
      if not env.taskset.bounded:
        raise ValueError(f"verifiers taskset {taskset!r} never ends; rlx indexes a taskset's "
                         "tasks as its rows, so it needs a bounded one")
      tasks = list(env.taskset)
      if not tasks:
        raise ValueError(f"verifiers taskset {taskset!r} has no tasks")
      _loaded[key] = (env, tasks)
    return _loaded[key]


class TaskRows:
  """A taskset's tasks as rlx's random-access source of prompt rows."""

  def __init__(self, taskset: str, options: str = ""):
    self.taskset, self.options = taskset, options
    self.tasks = environment(taskset, options)[1]
    self.skipped, self.first_skipped = 0, None

  def __len__(self) -> int:
    return len(self.tasks)

  def __getitem__(self, index: int) -> dict:
    data = self.tasks[index].data
    return {"prompt": data.prompt_text, "answer": "", "verifiers_task": index,
            "where": f"verifiers taskset {self.taskset}, task {index}"}

  def fingerprint(self) -> dict:
    return {"verifiers_taskset": self.taskset, "options": self.options, "tasks": len(self)}


class _Serving:
  """One ``env.serving()`` (the interception proxy, shared tool servers) per event loop, held
  while any of the loop's episodes runs: it keeps the env's per-run state, so the episodes of
  a batch share one and a new batch's loop opens its own."""

  def __init__(self, env):
    self.env, self.users = env, 0
    self.ready, self.done = asyncio.Event(), asyncio.Event()
    self.task: asyncio.Task | None = None
    self.error: BaseException | None = None

  async def _hold(self):
    try:
      async with self.env.serving():
        self.ready.set()
        await self.done.wait()
    except BaseException as error:  # noqa: BLE001 - handed to every episode waiting on it
      self.error = error
      self.ready.set()

  async def __aenter__(self):
    self.users += 1
    if self.task is None:
      self.task = asyncio.get_running_loop().create_task(self._hold())
    try:
      await self.ready.wait()
      if self.error is not None:
        raise RuntimeError(f"verifiers could not start serving: {self.error}") from self.error
    except BaseException:  # cancelled (the episode's timeout) or failed: not a user any more
      self._leave()
      raise

  async def __aexit__(self, *exc):
    if self._leave():
      await asyncio.shield(self.task)

  def _leave(self) -> bool:
    """One user fewer; True when it was the last (the serving context then closes)."""
    self.users -= 1
    if self.users == 0:
      self.done.set()
      return True
    return False


_serving: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def program(taskset: str, options: str = "", model: str = "policy"):
  """The agent program that plays one task of a ``verifiers`` taskset per episode."""
  vf = _import()
  env, tasks = environment(taskset, options)
  os.environ.setdefault(_KEY_VARIABLE, "rlx")

  async def run(client, row: dict) -> dict:
    task = tasks[int(row["verifiers_task"])]
    context = vf.ModelContext(model=model, client=vf.EvalClientConfig(
        base_url=str(client.base_url).rstrip("/"), api_key_var=_KEY_VARIABLE,
        headers={_HEADER: client.api_key}))
    loop = asyncio.get_running_loop()
    serving = _serving.get(loop)
    if serving is None or serving.done.is_set():
      serving = _serving[loop] = _Serving(env)
    async with serving:
      episode = await env.run_episode(task, context)
    if not episode.ok:
      errors = [*episode.errors, *(e for trace in episode.traces for e in trace.errors)]
      raise RuntimeError("the verifiers episode failed: " + ("; ".join(
          f"{e.type}: {e.message}" for e in errors) or "no trace completed"))
    rewards = [trace.reward for trace in episode.traces]
    return {"reward": sum(rewards) / len(rewards)}

  run.shared_loop = True  # the taskset's asyncio objects serve every episode: one event loop
  return run
