"""OpenEnv environments as rlx environments, with one config line.

    --config.env.name=openenv:my_package.server:EchoEnvironment

names an OpenEnv ``Environment`` subclass (made once per episode, without arguments), or a
factory ``(row) -> environment``, which may also return a synchronous client of an environment
served elsewhere (``MyEnvClient(base_url=...).sync()``). Needs OpenEnv: ``pip install openenv``
(0.10 on; ``openenv-core`` before, the same ``openenv.core`` modules).

- The first messages: the row's ``prompt`` (if any), then the text of the observation that
  ``reset()`` returns.
- Each assistant turn becomes the environment's action: an action model with a single required
  text field gets the turn's text in it; any other action model is read from the turn as JSON.
  A turn that is not a valid action gets a message saying why, and is counted in
  ``malformed_calls``; the episode goes on.
- Each observation's ``reward`` is the turn's reward and ``done`` ends the episode; its other
  fields become the next user message (the one text field as it is, several as JSON).
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable

from rlx.envs.contract import Observation

_BASE_FIELDS = ("done", "reward", "metadata")


def _action_type(env) -> type | None:
  """The pydantic action model ``env.step`` takes (from its annotation)."""
  try:
    hints = typing.get_type_hints(type(env).step)
  except Exception:  # noqa: BLE001 - unresolvable annotations: no action model known
    return None
  for name, hint in hints.items():
    if name != "return" and isinstance(hint, type) and hasattr(hint, "model_validate"):
      return hint
  return None


def _text_field(model: type) -> str | None:
  """The one required str field of an action model, if that is all it needs."""
  required = [(name, field) for name, field in model.model_fields.items() if field.is_required()]
  if len(required) == 1 and required[0][1].annotation is str:
    return required[0][0]
  return None


def observation_text(observation) -> str:
  """An observation's fields (done, reward and metadata aside) as the model reads them."""
  if hasattr(observation, "model_dump"):
    fields = observation.model_dump(exclude=set(_BASE_FIELDS))
  elif isinstance(observation, dict):
    fields = {k: v for k, v in observation.items() if k not in _BASE_FIELDS}
  else:
    return str(observation)
  texts = [value for value in fields.values() if isinstance(value, str)]
  if len(fields) == 1 and texts:
    return texts[0]
  return json.dumps(fields, default=str)


class OpenEnvEpisode:
  """One episode of an OpenEnv environment, behind rlx's ``reset`` / ``step``."""

  def __init__(self, env, row: dict):
    self.env, self.row = env, row
    self.action = _action_type(env)
    self.field = _text_field(self.action) if self.action is not None else None

  @staticmethod
  def _unpack(result):
    """(observation, reward, done) of ``reset``/``step``: an observation, or a client's
    StepResult."""
    if hasattr(result, "observation"):
      observation = result.observation
      return observation, result.reward, bool(result.done)
    return result, getattr(result, "reward", None), bool(getattr(result, "done", False))

  def reset(self) -> list[dict]:
    observation, _, _ = self._unpack(self.env.reset())
    parts = [self.row.get("prompt", ""), observation_text(observation)]
    return [{"role": "user", "content": "\n\n".join(p for p in parts if p)}]

  def _act(self, text: str):
    if self.action is None:
      return text
    if self.field is not None:
      return self.action(**{self.field: text})
    return self.action.model_validate_json(text.strip())

  def step(self, text: str) -> Observation:
    try:
      action = self._act(text)
    except ValueError as error:  # pydantic's ValidationError is a ValueError
      return Observation(
          messages=[{"role": "user", "content": f"That is not a valid action: {error}"}],
          info={"malformed_calls": 1})
    observation, reward, done = self._unpack(self.env.step(action))
    return Observation(
        messages=[] if done else [{"role": "user", "content": observation_text(observation)}],
        reward=None if reward is None else float(reward), done=done)


def factory(reference: str) -> Callable[[dict], OpenEnvEpisode]:
  """The rlx factory of ``openenv:package.module:Name`` (see the module docstring)."""
  from rlx.rewards.functions import _import  # noqa: PLC0415

  target = _import(reference)
  if inspect.isclass(target):
    return lambda row: OpenEnvEpisode(target(), row)
  return lambda row: OpenEnvEpisode(target(row), row)
