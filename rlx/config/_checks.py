"""The config's errors and field checks."""

from __future__ import annotations


class ConfigError(ValueError):
  """A config value or override is invalid; the message names the key and the fix."""


def _check(ok: bool, key: str, message: str) -> None:
  if not ok:
    raise ConfigError(f"config.{key}: {message}")


def _positive(section, prefix: str, *names: str) -> None:
  for name in names:
    value = getattr(section, name)
    _check(value > 0, f"{prefix}.{name}", f"must be > 0, got {value}")
