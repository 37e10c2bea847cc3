"""What an environment is, and how a run finds the one it names.

An environment is made per episode from a data row, by a factory ``make_env(row)``. It gives
the first messages, then answers each assistant turn::

    class Guess:
      def __init__(self, row):
        self.secret, self.tries = int(row["answer"]), 0

      def reset(self) -> list[dict]:                          # the first messages
        return [{"role": "user", "content": "Guess my number (1-100)."}]

      def step(self, text: str) -> rlx.envs.Observation:      # one assistant turn, as text
        self.tries += 1
        guess = int(text.strip() or 0)
        if guess == self.secret:
          return Observation(reward=1.0, done=True)
        hint = "higher" if guess < self.secret else "lower"
        return Observation(messages=[{"role": "user", "content": hint}])

An environment may hold state across turns (files, a board, a sandbox's session). It sees
each assistant turn as decoded text; the tokens that are trained on are the sampled ones,
never this text encoded again. ``tools`` (optional) lists the functions whose schemas the
chat template shows the model (see ``rlx.envs.tools``); an environment built on
``ToolEnv`` runs the calls for you, in worker processes with a timeout.

A factory is named like a reward: ``env.name='my_env.py:make_env'`` or
``'package.module:make_env'``; the built-in ones are ``calc`` and ``code``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from rlx.rewards.functions import RewardError, _import

Message = dict[str, Any]


@dataclasses.dataclass
class Observation:
  """The environment's answer to one assistant turn."""

  messages: list[Message] = dataclasses.field(default_factory=list)
  """New messages for the model (tool results, a user's reply); appended to the episode as the
  chat template renders them."""
  reward: float | None = None
  """A reward for this turn (summed over the episode), or None."""
  done: bool = False
  """The episode is over (the final reward, if any, comes with it)."""
  info: dict[str, float] = dataclasses.field(default_factory=dict)
  """Counts of this turn for the run's metrics: ``tool_calls``, ``tool_errors``,
  ``tool_timeouts``, ``malformed_calls`` (what ``ToolEnv`` reports), and ``correct`` (1 when
  the episode's answer is right: held-out accuracy counts it)."""


@runtime_checkable
class Environment(Protocol):
  """One episode's environment (see the module docstring)."""

  def reset(self) -> list[Message]:
    """The episode's first messages (a system prompt, the task)."""

  def step(self, text: str) -> Observation:
    """The answer to one assistant turn (its decoded text)."""


def tools_of(env: Environment) -> Sequence[Callable]:
  """The tools an environment shows the model (none when it has no ``tools`` attribute)."""
  return tuple(getattr(env, "tools", ()) or ())


def load_factory(name: str) -> Callable[[dict], Environment]:
  """The environment factory ``env.name`` names: a built-in (``calc``, ``code``) or
  ``'package.module:function'`` / ``'path/to/file.py:function'``, or an OpenEnv environment as
  ``'openenv:package.module:Environment'`` (``rlx.envs.openenv``). Raises ValueError naming
  the problem."""
  from rlx.envs.builtin import FACTORIES  # noqa: PLC0415 - built-ins import this module

  if name in FACTORIES:
    return FACTORIES[name]
  if name.startswith("openenv:"):
    from rlx.envs.openenv import factory  # noqa: PLC0415 - needs openenv

    try:
      return factory(name.removeprefix("openenv:"))
    except RewardError as error:
      raise ValueError(str(error).replace("reward ", "OpenEnv environment ", 1)) from None
  if ":" not in name:
    raise ValueError(f"unknown environment {name!r}; choose one of {', '.join(FACTORIES)}, or "
                     "name your own factory as 'package.module:function' or "
                     "'path/to/file.py:function'")
  try:
    return _import(name)
  except RewardError as error:
    raise ValueError(str(error).replace("reward ", "environment ", 1)) from None


def load_agent(name: str, verifiers_config: str = "") -> Callable:
  """The agent program ``env.agent`` names (``'path/to/file.py:run'`` or
  ``'package.module:run'``), an ``async def run(client, row)``, or the one that plays a
  ``verifiers`` taskset (``'verifiers:TASKSET_ID'``, ``rlx.envs.verifiers``, configured by
  ``verifiers_config``); ValueError naming the problem."""
  import inspect  # noqa: PLC0415

  from rlx.envs import verifiers  # noqa: PLC0415 - imports the verifiers package only when used

  taskset = verifiers.taskset_id(name)
  if taskset is not None:
    return verifiers.program(taskset, verifiers_config)
  if ":" not in name:
    raise ValueError(f"agent program {name!r}: name it as 'path/to/file.py:function' or "
                     "'package.module:function'")
  try:
    agent = _import(name)
  except RewardError as error:
    raise ValueError(str(error).replace("reward ", "agent program ", 1)) from None
  if not inspect.iscoroutinefunction(agent):
    raise ValueError(f"agent program {name!r} must be an 'async def run(client, row)'")
  return agent


def check_env(env: object, name: str) -> Environment:
  """``env`` if it has ``reset`` and ``step``; else a ValueError naming the factory."""
  if not isinstance(env, Environment):
    raise ValueError(f"environment {name!r} made a {type(env).__name__}, which lacks "
                     "reset() -> list[dict] and step(text) -> Observation")
  return env
