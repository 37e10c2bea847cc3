"""Reward functions the loop tests name in ``config.reward.name`` (a light module: reward
workers import it)."""


def odd_length(response: str, row: dict) -> float:
  """Varied rewards within a group, whatever the model says."""
  del row
  return float(len(response) % 2)


def constant(response: str, row: dict) -> float:
  """The same reward for every answer: no group ever has varied rewards."""
  return 0.0
