"""Command line of rlx: load a config file, apply typed dotted overrides, print help.

    python -m rlx.main --config configs/X.py --workdir DIR [--config.section.field=value ...]

Overrides are parsed against the ``RunConfig`` schema: an unknown key or a value
of the wrong type raises ``ConfigError`` naming the key and the closest valid
keys, before anything runs. Standard library only, like ``rlx.config``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.util
import inspect
import json
import os
import pathlib
import sys
import textwrap
import types
import typing
from typing import Any, Literal

from rlx.config import ConfigError, RunConfig, check

OVERRIDE_PREFIX = "--config."


@dataclasses.dataclass(frozen=True)
class Invocation:
  """What the command line asked for."""

  config: RunConfig
  config_path: str
  workdir: pathlib.Path
  overrides: tuple[str, ...]


USAGE = """\
usage: python -m rlx.main --config configs/X.py --workdir DIR [--config.section.field=value ...]

  --config PATH        a Python file whose get_config() returns an rlx.config.RunConfig
  --workdir DIR        run directory: config.json, checkpoints, metrics (resumes if it holds a checkpoint)
  --config.a.b=VALUE   override one field, typed against the schema below
  --help               this text and every config field
"""


def _help_config(argv: list[str]) -> tuple[RunConfig | None, str]:
  """The config ``--config`` names in ``argv`` (with its overrides), for ``--help`` to show its
  values; (None, why) when there is none or it does not load."""
  path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if path is None and "--config" in argv and argv.index("--config") + 1 < len(argv):
    path = argv[argv.index("--config") + 1]
  if path is None:
    return None, ""
  try:
    return apply_overrides(load_config_file(path),
                           [a for a in argv if a.startswith(OVERRIDE_PREFIX)]), path
  except ConfigError as error:
    return None, f"{path} (not loaded: {error})"


def _print_help(argv: list[str]) -> None:
  """The usage and every field, with the values of the config given with ``--config`` (else
  the defaults); a reader that closes the pipe early (``--help | head``) ends it quietly."""
  config, source = _help_config(argv)
  try:
    print(USAGE)
    print(f"Values shown: {source if config is not None else 'the defaults'}"
          + ("" if config is not None or not source else f"; {source}") + "\n")
    print(describe_fields(RunConfig, default=config), flush=True)
  except BrokenPipeError:
    # the interpreter's own flush at exit would raise again: point stdout at nothing
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def parse_args(argv: list[str]) -> Invocation | None:
  """Parses argv (without the program name); returns None when help was printed."""
  if not argv or "--help" in argv or "-h" in argv:
    _print_help(argv)
    return None
  config_path, workdir, overrides = None, None, []
  args = list(argv)
  while args:
    arg = args.pop(0)
    if arg.startswith(OVERRIDE_PREFIX):
      if "=" not in arg:
        if not args:
          raise ConfigError(f"{arg}: missing value; write {arg}=VALUE")
        arg = f"{arg}={args.pop(0)}"
      overrides.append(arg)
    elif arg.split("=", 1)[0] in ("--config", "--workdir"):
      flag, _, value = arg.partition("=")
      if not value:
        if not args:
          raise ConfigError(f"{flag} needs a value")
        value = args.pop(0)
      if flag == "--config":
        config_path = value
      else:
        workdir = value
    else:
      close = difflib.get_close_matches(arg.split("=", 1)[0], ["--config", "--workdir", "--help"], n=1)
      hint = f"; did you mean {close[0]}?" if close else ""
      raise ConfigError(f"unknown argument {arg!r}{hint} (overrides look like --config.section.field=value)")
  if config_path is None:
    raise ConfigError("--config is required, e.g. --config configs/dapo_split.py")
  if workdir is None:
    raise ConfigError("--workdir is required: the directory that receives config.json, checkpoints and metrics")
  config = check(apply_overrides(load_config_file(config_path), overrides))
  return Invocation(config, config_path, pathlib.Path(workdir), tuple(overrides))


def load_config_file(path: str) -> RunConfig:
  """Imports a config file and returns its ``get_config()``."""
  file = pathlib.Path(path)
  if not file.is_file():
    raise ConfigError(f"config file {path!r} does not exist")
  # The shipped configs are the package rlx.configs (`from rlx.configs import base`); a config
  # written before they moved there imports them as `configs`: the same modules.
  if "configs" not in sys.modules:
    sys.modules["configs"] = importlib.import_module("rlx.configs")
  spec = importlib.util.spec_from_file_location(f"_rlx_config_{file.stem}", file)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}") from e
  get_config = getattr(module, "get_config", None)
  if get_config is None:
    raise ConfigError(f"config file {path!r} has no get_config() function")
  config = get_config()
  if not isinstance(config, RunConfig):
    raise ConfigError(f"{path}: get_config() returned {type(config).__name__}, expected rlx.config.RunConfig")
  return config


def apply_overrides(config: RunConfig, overrides: list[str] | tuple[str, ...]) -> RunConfig:
  """Applies ``--config.a.b=value`` strings to a config, checking keys and types."""
  for override in overrides:
    key, sep, raw = override.removeprefix(OVERRIDE_PREFIX).partition("=")
    if not sep:
      raise ConfigError(f"{override}: missing '=VALUE'")
    config = _set(config, key.split("."), raw, key)
  return config


def _set(node: Any, path: list[str], raw: str, key: str) -> Any:
  fields = {f.name: f for f in dataclasses.fields(node)}
  name = path[0]
  if name not in fields:
    parts = key.split(".")
    raise ConfigError(_unknown_key(type(node), ".".join(parts[: len(parts) - len(path)]), name, key))
  hint = _type_hints(type(node))[name]
  if dataclasses.is_dataclass(hint):
    if len(path) == 1:
      children = ", ".join(f"{key}.{f.name}" for f in dataclasses.fields(hint))
      raise ConfigError(f"config.{key} is a section, not a value; set one of its fields: {children}")
    value = _set(getattr(node, name), path[1:], raw, key)
  else:
    if len(path) > 1:
      raise ConfigError(f"config.{'.'.join(key.split('.')[:-len(path) + 1])} is a value, not a section")
    value = _parse_value(raw, hint, key)
  try:
    return dataclasses.replace(node, **{name: value})
  except ConfigError:
    raise
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.{key}={raw!r}: {e}") from e


# what other trainers call fields rlx names otherwise (TRL, verl, OpenRLHF)
_ALIASES = {
    "lr": "optimizer.learning_rate", "learning_rate": "optimizer.learning_rate",
    "max_steps": "trainer.steps", "num_steps": "trainer.steps", "total_steps": "trainer.steps",
    "batch_size": "data.prompts_per_step", "train_batch_size": "data.prompts_per_step",
    "num_generations": "rollout.group_size", "n_samples": "rollout.group_size",
    "beta": "algorithm.kl_coef", "max_completion_length": "rollout.max_new_tokens",
    "max_prompt_length": "rollout.max_prompt_len", "epochs": "trainer.ppo_epochs",
    "seed": "trainer.seed", "model_name_or_path": "model.path", "output_dir": "--workdir",
    # partial rollouts (AReaL, ROLL, verl's fully-async trainer): new weights reach sequences
    # still decoding
    "partial": "mesh.inflight_updates", "partial_rollout": "mesh.inflight_updates",
}


def _unknown_key(cls: type, section: str, name: str, key: str) -> str:
  prefix = f"{section}." if section else ""
  valid = [f.name for f in dataclasses.fields(cls)]
  everywhere = leaf_keys(RunConfig)
  alias = _ALIASES.get(name)
  if alias is not None and alias != key:
    where = alias if alias.startswith("--") else f"config.{alias}"
    return f"unknown key config.{key}; rlx calls it {where}"
  close = [prefix + c for c in difflib.get_close_matches(name, valid, n=3, cutoff=0.6)]
  close += [k for k in difflib.get_close_matches(key, everywhere, n=3, cutoff=0.75) if k not in close]
  close += [k for k in everywhere if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1] and k not in close]
  hint = ("; closest valid keys: " + ", ".join(f"config.{c}" for c in close[:4])) if close else ""
  where = f"config.{section}" if section else "the config"
  return f"unknown key config.{key}{hint} (valid keys of {where}: {', '.join(valid)})"


@functools.cache
def leaf_keys(cls: type, prefix: str = "") -> tuple[str, ...]:
  """Every dotted key that can be overridden, e.g. 'rollout.top_k'."""
  keys = []
  for f in dataclasses.fields(cls):
    hint = _type_hints(cls)[f.name]
    keys += leaf_keys(hint, f"{prefix}{f.name}.") if dataclasses.is_dataclass(hint) else [prefix + f.name]
  return tuple(keys)


def _parse_value(raw: str, hint: Any, key: str) -> Any:
  """Converts a command-line string to the annotated type, or raises ConfigError."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    if type(None) in args and raw.lower() in ("none", "null"):
      return None
    errors = []
    for arm in (a for a in args if a is not type(None)):
      try:
        return _parse_value(raw, arm, key)
      except ConfigError as e:
        errors.append(str(e))
    raise ConfigError(errors[0] if len(errors) == 1 else f"config.{key}={raw!r}: not a valid {_type_name(hint)}")
  if origin is Literal:
    for option in args:
      if str(option) == raw:
        return option
    close = difflib.get_close_matches(raw, [str(a) for a in args], n=1)
    hint_text = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"config.{key}={raw!r}: must be one of {', '.join(map(repr, args))}{hint_text}")
  if hint is bool:
    lowered = raw.lower()
    if lowered in ("true", "1", "yes"):
      return True
    if lowered in ("false", "0", "no"):
      return False
    raise ConfigError(f"config.{key}={raw!r}: expected a bool (true or false)")
  if hint in (int, float, str):
    try:
      return hint(raw)
    except ValueError:
      raise ConfigError(f"config.{key}={raw!r}: expected {hint.__name__}") from None
  if origin is tuple:
    try:
      value = json.loads(raw)
    except json.JSONDecodeError:
      raise ConfigError(f"config.{key}={raw!r}: expected a JSON list, e.g. "
                        f"'{json.dumps(_example(hint))}'") from None
    return _from_json(value, hint, key)
  raise ConfigError(f"config.{key}: overriding a {_type_name(hint)} from the command line is not supported")


def _example(hint: Any) -> Any:
  """A value of type ``hint`` to show in a message (its shape, not a recommendation)."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin is tuple:
    if len(args) == 2 and args[1] is Ellipsis:
      return [_example(args[0])]
    return [_example(a) for a in args]
  if origin in (typing.Union, types.UnionType):
    return _example(next(a for a in args if a is not type(None)))
  return {str: "text", int: 2, float: 0.5, bool: True}.get(hint, "...")


def _from_json(value: Any, hint: Any, key: str) -> Any:
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin is tuple:
    if not isinstance(value, list):
      raise ConfigError(f"config.{key}: expected a list for {_type_name(hint)}, got {value!r}")
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_from_json(v, args[0], key) for v in value)
    if len(value) != len(args):
      raise ConfigError(f"config.{key}: expected {len(args)} items, got {value!r}")
    return tuple(_from_json(v, a, key) for v, a in zip(value, args))
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    hint = next(a for a in args if a is not type(None))
  if isinstance(hint, type) and isinstance(value, hint):
    return value
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)  # JSON writes 1.0 as 1 where it can
  raise ConfigError(f"config.{key}: expected {_type_name(hint)}, got {value!r}")


def _type_name(hint: Any) -> str:
  if typing.get_origin(hint) is Literal:
    return " | ".join(repr(a) for a in typing.get_args(hint))
  return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
  """The docstring written under each field of a dataclass, by field name."""
  tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
  body = tree.body[0].body
  docs = {}
  for node, following in zip(body, body[1:]):
    if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
        and isinstance(following.value.value, str)):
      docs[node.target.id] = " ".join(following.value.value.split())
  return docs


def describe_fields(cls: type, prefix: str = "config.", default: Any = None) -> str:
  """One line per leaf field: dotted key, type, default and its docstring."""
  default = cls() if default is None else default
  docs, lines = field_docs(cls), []
  for f in dataclasses.fields(cls):
    hint, value = _type_hints(cls)[f.name], getattr(default, f.name)
    if dataclasses.is_dataclass(hint):
      lines.append(f"\n{prefix}{f.name}: {docs.get(f.name, '')}")
      lines.append(describe_fields(hint, f"{prefix}{f.name}.", value))
    else:
      lines.append(f"  --{prefix}{f.name}={value!r}  ({_type_name(hint)})\n      {docs.get(f.name, '')}")
  return "\n".join(lines)


def config_from_json(data: dict, cls: type = RunConfig, prefix: str = "") -> Any:
  """The config ``to_json`` wrote (``WORKDIR/config.json``), loaded back; a field the file
  lacks (added since) takes its default, a key the schema lacks (removed since) is ignored."""
  hints, values = _type_hints(cls), {}
  for f in dataclasses.fields(cls):
    if f.name not in data:
      continue
    hint, value = hints[f.name], data[f.name]
    if dataclasses.is_dataclass(hint):
      values[f.name] = config_from_json(value, hint, f"{prefix}{f.name}.")
    elif isinstance(value, list):  # a tuple field (possibly optional)
      arms = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) \
          else (hint,)
      tuple_hint = next(a for a in arms if typing.get_origin(a) is tuple)
      values[f.name] = _from_json(value, tuple_hint, prefix + f.name)
    else:
      values[f.name] = value
  return cls(**values)


def to_json(config: RunConfig) -> str:
  """The resolved config as JSON (what is written to WORKDIR/config.json)."""
  return json.dumps(dataclasses.asdict(config), indent=2)


def config_changes(before: dict, config: RunConfig, limit: int = 8) -> list[str]:
  """The fields where ``config`` differs from an earlier run's (its ``config.json``, loaded),
  as ``"section.key: old -> new"``."""
  def flat(tree, prefix=""):
    if isinstance(tree, dict):
      for key, value in tree.items():
        yield from flat(value, f"{prefix}{key}.")
    else:
      yield prefix[:-1], tree

  old, new = dict(flat(before)), dict(flat(json.loads(to_json(config))))
  changed = [f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
             for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]
  return changed[:limit] + ([f"... {len(changed) - limit} more"] if len(changed) > limit else [])


def main_error(error: ConfigError) -> int:
  """Prints a config error the way the CLI reports it; returns the exit status."""
  print(f"rlx: error: {error}", file=sys.stderr)
  print("nothing was run; see `python -m rlx.main --help` for every key.", file=sys.stderr)
  return 2


_stops_at_start: list[str] = []


def stop_at_start(name: str) -> None:
  """Records the stop signal ``name`` that came during start-up, before the training loop took
  the signals over (called from the signal handler: no imports, no allocation to speak of).
  The start-up's own exception for it can be swallowed where it lands (a KeyboardInterrupt
  inside a garbage-collector callback or an import is only printed), so the loop takes the
  record too (``take_stop_at_start``) and stops before it trains."""
  _stops_at_start.append(name)


class StoppedAtStart(Exception):
  """SIGTERM before the training loop took over the stop signals."""


def stopped_at_start() -> bool:
  """Whether a stop signal came during start-up and was not taken yet."""
  return bool(_stops_at_start)


def end_start_up() -> None:
  """Raises what the start-up's signal handler raises for the recorded stop signal (for a
  long start-up stage, such as the warm-up, that checks for one its exception missed):
  KeyboardInterrupt for SIGINT, ``StoppedAtStart`` for SIGTERM."""
  raise KeyboardInterrupt if take_stop_at_start() == "SIGINT" else StoppedAtStart


def take_stop_at_start() -> str | None:
  """The first stop signal recorded during start-up, once; None when none came."""
  name = _stops_at_start[0] if _stops_at_start else None
  _stops_at_start.clear()
  return name
