"""One episode's bookkeeping on the host: its environment, the messages so far, the tool calls
of each turn and what they cost.

    episode = Episode(env, renderer, runner, tools, format="builtin")
    prompt_ids = episode.start()
    reply = episode.respond(text, finish_reason)    # after each assistant turn
    reply.tokens, reply.done, reply.truncated

A turn that calls tools (of an environment that lists them) is answered here: each call runs
in the ``ToolRunner`` (a timeout, a crash, a non-text result or an unreadable call becomes an
error message the model reads) and the results are tool-role messages. A turn without a call
goes to the environment's ``step``. An environment's own failure (``step`` raising) ends the
episode, counted; nothing here raises for what a model, a tool or an environment does.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import numbers
import time
from collections.abc import Callable, Sequence

from rlx.envs.calls import Format, MalformedCall, bind, parse
from rlx.envs.contract import Environment, Message, Observation
from rlx.envs.render import Renderer
from rlx.envs.tools import ToolRunner, reference, schema

COUNTS = ("tool_calls", "tool_errors", "tool_timeouts", "malformed_calls", "env_errors")


class EnvError(ValueError):
  """An environment broke its contract at ``reset`` (the row is skipped and counted)."""


def _not_messages(messages) -> str | None:
  """What is wrong with ``messages`` as chat messages, or None."""
  if not isinstance(messages, (list, tuple)):
    return f"a {type(messages).__name__}, not a list of messages"
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      return f"message {i} as a {type(m).__name__}, not a dict with role and content"
    if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
      return f"message {i} without a string role and content: {str(m)[:120]}"
  return None


def _invalid(observation: Observation) -> str | None:
  """What is wrong with an environment's observation, or None."""
  problem = _not_messages(observation.messages)
  if problem:
    return f"an Observation with {problem}"
  reward = observation.reward
  if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)
                             or not math.isfinite(reward)):
    return f"an Observation whose reward is {reward!r}, not a finite number"
  return None


@dataclasses.dataclass(frozen=True)
class Toolbox:
  """The tools of an environment: their schemas, how workers import them, their parameters."""

  schemas: tuple[dict, ...]
  references: dict[str, str]
  parameters: dict[str, list[str]]
  bound: dict[str, dict]
  """Arguments fixed by the environment (a ``functools.partial``'s keywords, e.g. a row's
  tests), passed to the call but not shown to the model."""

  @classmethod
  def of(cls, tools: Sequence[Callable]) -> Toolbox:
    schemas, references, parameters, bound = [], {}, {}, {}
    for tool in tools:
      fn, fixed = ((tool.func, dict(tool.keywords)) if isinstance(tool, functools.partial)
                   else (tool, {}))
      if isinstance(tool, functools.partial) and tool.args:
        raise ValueError(f"tool {fn.__name__}: fix its arguments by keyword in functools.partial")
      described = schema(fn)
      shown = described["function"]["parameters"]
      shown["properties"] = {k: v for k, v in shown["properties"].items() if k not in fixed}
      shown["required"] = [k for k in shown["required"] if k not in fixed]
      schemas.append(described)
      references[fn.__name__] = reference(fn)
      parameters[fn.__name__] = [p for p in inspect.signature(fn).parameters if p not in fixed]
      bound[fn.__name__] = fixed
    return cls(tuple(schemas), references, parameters, bound)


@dataclasses.dataclass
class Reply:
  """What comes after an assistant turn."""

  tokens: list[int]
  """The environment's tokens to append (empty when the episode is over)."""
  done: bool
  truncated: bool = False
  """It ended on a limit (turns, tokens, an environment that failed), not by the environment."""


class Episode:
  """An environment, and everything one episode said and cost (see the module docstring)."""

  def __init__(self, env: Environment, renderer: Renderer, runner: ToolRunner,
               toolbox: Toolbox | None, *, format: Format, max_turns: int,
               max_observation_chars: int = 0, system: str = ""):
    self.env, self.renderer, self.runner, self.toolbox = env, renderer, runner, toolbox
    self.system = system
    """A system message put first when the environment's first messages have none."""
    self.format, self.max_turns = format, max_turns
    self.max_observation_chars = max_observation_chars
    """An environment message longer than this is cut, as a tool result is (0: never)."""
    self.messages: list[Message] = []
    self.turns = 0
    self.reward = 0.0
    self.rewarded = False
    """The environment gave a reward (else the run's reward function scores the episode)."""
    self.counts = dict.fromkeys(COUNTS, 0)
    self.info: dict[str, float] = {}
    self.tool_seconds: list[tuple[str, float]] = []
    self.env_seconds = 0.0
    self.tool_wait_seconds = 0.0
    """Seconds its tool calls waited for a free tool worker."""
    self.final_text = ""
    self.error: str | None = None
    """Why the environment ended the episode by failing (its first words are logged)."""

  def start(self) -> list[int]:
    """The prompt of the first messages; raises ``EnvError`` naming what ``reset`` did wrong
    (raised, or returned something other than chat messages)."""
    started = time.perf_counter()
    try:
      messages = self.env.reset()
    except Exception as error:  # noqa: BLE001 - the caller skips the row, counted
      raise EnvError(f"reset() raised {type(error).__name__}: {error}") from error
    finally:
      self.env_seconds += time.perf_counter() - started
    problem = _not_messages(messages)
    if problem:
      raise EnvError(f"reset() returned {problem}")
    self.messages = [self._cut(m) for m in messages]
    if self.system and not (self.messages and self.messages[0].get("role") == "system"):
      self.messages.insert(0, {"role": "system", "content": self.system})
    return self.renderer.prompt(self.messages)

  def _cut(self, message: Message) -> Message:
    limit, content = self.max_observation_chars, message["content"]
    if not limit or len(content) <= limit:
      return message
    return dict(message, content=content[:limit] + f"... [cut: {len(content) - limit} more "
                "characters]")

  def respond(self, text: str, finish_reason: str) -> Reply:
    """The answer to the assistant turn ``text`` (decoded), which ended on a stop token
    ('stop') or a length limit ('length')."""
    started = time.perf_counter()
    try:
      return self._respond(text, finish_reason)
    finally:
      self.env_seconds += time.perf_counter() - started

  def _respond(self, text: str, finish_reason: str) -> Reply:
    self.turns += 1
    self.messages.append({"role": "assistant", "content": text})
    self.final_text = text
    if finish_reason != "stop":
      return Reply([], done=True, truncated=True)
    calls = None
    if self.toolbox is not None:
      try:
        calls = parse(text, self.format)
      except MalformedCall as error:
        self.counts["malformed_calls"] += 1
        calls = [error]
    if calls:
      observation = Observation(messages=[self._run(call) for call in calls])
    else:
      try:
        observation = self.env.step(text)
      except Exception as error:  # noqa: BLE001 - a failing environment ends its episode only
        self.counts["env_errors"] += 1
        self.error = f"{type(error).__name__}: {error}"
        return Reply([], done=True, truncated=True)
      problem = (f"a {type(observation).__name__}, not an Observation"
                 if not isinstance(observation, Observation) else _invalid(observation))
      if problem:  # checked here, not where the renderer or the learner would trip on it
        self.counts["env_errors"] += 1
        self.error = f"step() returned {problem}"
        return Reply([], done=True, truncated=True)
      observation = dataclasses.replace(
          observation, messages=[self._cut(m) for m in observation.messages])
    if observation.reward is not None:
      self.reward += float(observation.reward)
      self.rewarded = True
    for key, value in observation.info.items():
      self.info[key] = self.info.get(key, 0) + value
      if key in self.counts:  # the environment's own tool calls and unreadable turns
        self.counts[key] += value
    self.messages.extend(observation.messages)
    if observation.done:
      return Reply([], done=True)
    if self.turns >= self.max_turns:
      return Reply([], done=True, truncated=True)
    return Reply(self.renderer.increment(observation.messages), done=False)

  def _run(self, call) -> Message:
    """The tool message answering one call (or an unreadable one)."""
    if isinstance(call, MalformedCall):
      return {"role": "tool", "content": f"error: {call}"}
    self.counts["tool_calls"] += 1
    name = call.name
    if name not in self.toolbox.references:
      self.counts["tool_errors"] += 1
      return {"role": "tool", "name": name, "content":
              f"error: there is no tool {name!r}; the tools are "
              f"{', '.join(self.toolbox.references)}"}
    try:
      arguments = bind(call, self.toolbox.parameters[name])
    except MalformedCall as error:
      self.counts["malformed_calls"] += 1
      return {"role": "tool", "name": name, "content": f"error: {error}"}
    result = self.runner.call(self.toolbox.references[name],
                              {**arguments, **self.toolbox.bound[name]})
    self.tool_seconds.append((name, result.seconds))
    self.tool_wait_seconds += result.waited
    if result.status == "timeout":
      self.counts["tool_timeouts"] += 1
    elif result.status == "error":
      self.counts["tool_errors"] += 1
    content = result.text if result.status == "ok" else f"error: {result.text}"
    return {"role": "tool", "name": name, "content": content}

  def transcript(self) -> str:
    """The messages as JSON (for reports and reward functions that read the whole episode)."""
    return json.dumps(self.messages)
