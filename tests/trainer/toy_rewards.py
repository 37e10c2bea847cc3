"""Reward functions the loop tests name in ``config.reward.name`` (a light module: reward
workers import it)."""


def odd_length(response: str, row: dict) -> float:
  """Varied rewards within a group, whatever the model says."""
  del row
  return float(len(response) % 2)


def constant(response: str, row: dict) -> float:
  """The same reward for every answer: no group ever has varied rewards."""
  return 0.0


def huge(response: str, row: dict) -> float:
  """A reward no float32 holds (1e39 is inf there)."""
  return 1e39


def misspelled(response: str, row: dict) -> float:
  """Reads a field the rows do not have: raises on every call."""
  return float(row["anwser"])
