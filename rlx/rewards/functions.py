"""What a reward is: a built-in verifier, the sandboxed ``code`` reward, or a user's function,
named in ``config.reward.name``, and how one call is judged.

    reward = RewardFn("my_rewards.py:score")          # or "package.module:function", "math", "code"
    check(reward)                                      # import errors now, naming file and function
    judge(reward, response, row)                       # Judged(reward, correct, components)

A user's function is ``(response: str, row: dict) -> float | dict``; the row is the whole
data row (prompt, answer and every other field of the file). A dict carries ``"reward"``
and, optionally, ``"correct"`` (what held-out accuracy counts; by default a reward of at
least 1) and any other named numbers, each logged as ``reward/<name>``. With
``batched=True`` it is ``(responses: list[str], rows: list[dict]) -> list[float | dict]``,
and may be ``async def`` (for a reward served by a model over HTTP).

``RewardFn`` is plain picklable data: reward workers resolve it to a function once each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from rlx.rewards.verifiers import VERIFIERS, format_reward

BUILTIN = (*VERIFIERS, "code")


class RewardError(ValueError):
  """A reward cannot be used: unknown name, import failure, not a function."""


@dataclasses.dataclass(frozen=True)
class CodeOptions:
  """The ``code`` reward: where a row's tests are and how a program is scored."""

  tests_field: str = "tests"
  """Row field with the tests: a list of assert statements, a list of {"input", "output"}
  pairs, or {"inputs": [...], "outputs": [...]} (stdin -> expected stdout)."""
  scoring: str = "fraction"
  """'fraction' of the tests passed, or 'all' (1 only when every test passes)."""
  timeout_s: float = 3.0
  """Wall-clock seconds a program may run (all its tests together)."""
  memory_mb: int = 512
  """Address space a program may use."""


@dataclasses.dataclass(frozen=True)
class RewardFn:
  """A reward by name, with what a worker needs to apply it."""

  name: str
  """A built-in verifier (``VERIFIERS``), ``"code"``, ``"package.module:function"``,
  ``"path/to/file.py:function"``, or a module-level function (the Python API)."""
  format_weight: float = 0.0
  """Weight of the format reward added to the reward (never to the verdict)."""
  batched: bool = False
  """The user function takes lists (and may be async)."""
  code: CodeOptions = dataclasses.field(default_factory=CodeOptions)
  extra: tuple[tuple[str, float], ...] = ()
  """More rewards, each (name, weight), named like ``name`` and called per response: their
  weighted sum is added to the reward, each is logged as ``reward/<its name>``, and none
  changes the verdict (``correct`` is the main reward's)."""


def from_config(reward, data_source: str) -> RewardFn:
  """The reward a run's ``config.reward`` names ('auto': the built-in task's own verifier, or
  'math' for data files)."""
  name = reward.name
  if name == "auto":
    name = data_source if data_source in BUILTIN else "math"
  return RewardFn(name, format_weight=reward.format_weight, batched=reward.batched,
                  code=CodeOptions(tests_field=reward.code_tests_field, scoring=reward.code_scoring,
                                   timeout_s=reward.code_timeout_s,
                                   memory_mb=reward.code_memory_mb),
                  extra=tuple((str(n), float(w)) for n, w in reward.extra))


class Judged(NamedTuple):
  """The reward, the verdict and the named components of one response."""

  reward: float
  correct: bool
  components: dict[str, float]


def is_user_function(name) -> bool:
  return not isinstance(name, str) or name not in BUILTIN


def check(reward: RewardFn) -> Callable:
  """The function ``reward`` names, resolved here (where errors are cheap to report); the
  extra rewards' too."""
  for name, _ in reward.extra:
    check(_extra(reward, name))
  name = reward.name
  if isinstance(name, str) and ":" not in name and name not in BUILTIN:
    raise RewardError(f"unknown reward {name!r}; choose one of {', '.join(BUILTIN)}, or name "
                      "your own function as 'package.module:function' or 'path/to/file.py:function'")
  return resolve(reward)


@functools.lru_cache(maxsize=None)
def resolve(reward: RewardFn) -> Callable:
  """``(response, row) -> float | dict`` (or the batched form) for ``reward``."""
  name = reward.name
  if not isinstance(name, str):
    return name
  if name in VERIFIERS:
    return lambda response, row: VERIFIERS[name](response, row["answer"])
  if name == "code":
    from rlx.rewards.sandbox import code_reward

    return functools.partial(code_reward, options=reward.code)
  return _import(name)


def _import(spec: str) -> Callable:
  where, _, attribute = spec.rpartition(":")
  if not where or not attribute:
    raise RewardError(f"reward {spec!r}: name a function as 'package.module:function' or "
                      "'path/to/file.py:function'")
  if where.endswith(".py"):
    path = pathlib.Path(where).expanduser().resolve()
    if not path.is_file():
      raise RewardError(f"reward {spec!r}: {path} does not exist")
    module_name = f"rlx_user_reward_{abs(hash(str(path)))}"
    module = sys.modules.get(module_name)
    if module is None:
      loader_spec = importlib.util.spec_from_file_location(module_name, path)
      module = importlib.util.module_from_spec(loader_spec)
      sys.path.insert(0, str(path.parent))  # its own helper modules beside it
      try:
        loader_spec.loader.exec_module(module)
      except BaseException as error:  # noqa: BLE001 - any failure to import is reported
        raise RewardError(f"reward {spec!r}: importing {path} failed: "
                          f"{type(error).__name__}: {error}") from error
      finally:
        sys.path.remove(str(path.parent))
      sys.modules[module_name] = module
  else:
    try:
      module = importlib.import_module(where)
    except BaseException as error:  # noqa: BLE001 - any failure to import is reported
      raise RewardError(f"reward {spec!r}: importing module {where!r} failed: "
                        f"{type(error).__name__}: {error}") from error
  function = getattr(module, attribute, None)
  if not callable(function):
    raise RewardError(f"reward {spec!r}: {where} has no function {attribute!r}"
                      + ("" if function is None else f" ({attribute} is a "
                         f"{type(function).__name__})"))
  return function


def judge(reward: RewardFn, response: str, row: dict) -> Judged:
  """One response's reward, verdict and components."""
  return _with_extras(reward, _judged(reward, resolve(reward)(response, row), response),
                      response, row)


def _extra(reward: RewardFn, name: str) -> RewardFn:
  return RewardFn(name, code=reward.code)


def extra_label(name: str) -> str:
  """What an extra reward is logged as: its function's name, or the built-in's."""
  return name.rpartition(":")[2] or name


def _with_extras(reward: RewardFn, judged: Judged, response: str, row: dict) -> Judged:
  """``judged`` plus the weighted extra rewards (the verdict unchanged)."""
  if not reward.extra:
    return judged
  value, components = judged.reward, dict(judged.components)
  for name, weight in reward.extra:
    extra = _judged(_extra(reward, name), resolve(_extra(reward, name))(response, row), response)
    value += weight * extra.reward
    components[extra_label(name)] = extra.reward
  return Judged(value, judged.correct, components)


def judge_batch(reward: RewardFn, responses: Sequence[str], rows: Sequence[dict]) -> list[Judged]:
  """A batched function's results for ``responses`` (awaited when it is async)."""
  function = resolve(reward)
  results = function(list(responses), list(rows))
  if inspect.isawaitable(results):
    results = asyncio.run(_awaited(results))
  results = list(results)
  if len(results) != len(responses):
    raise RewardError(f"a batched reward returned {len(results)} results for "
                      f"{len(responses)} responses")
  return [_with_extras(reward, _judged(reward, result, response), response, row)
          for result, response, row in zip(results, responses, rows)]


async def _awaited(awaitable):
  return await awaitable


def _judged(reward: RewardFn, result, response: str) -> Judged:
  components: dict[str, float] = {}
  if isinstance(result, dict):
    if "reward" not in result:
      raise RewardError(f"a reward returned a dict without 'reward' (keys: {', '.join(result)})")
    value = _number(result["reward"], "reward")
    correct = bool(result["correct"]) if "correct" in result else value >= 1.0
    components = {str(key): _number(item, key) for key, item in result.items()
                  if key not in ("reward", "correct")}
  else:
    value = _number(result, "reward")
    correct = value >= 1.0
  if reward.format_weight:
    value += reward.format_weight * format_reward(response)
  return Judged(value, correct, components)


def _number(value, name) -> float:
  try:
    number = float(value)
  except (TypeError, ValueError):
    raise RewardError(f"a reward returned {name}={value!r}, not a number") from None
  if not math.isfinite(number):
    raise RewardError(f"a reward returned {name}={number}")
  return number
