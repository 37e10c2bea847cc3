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


_CALLS = [0]


def hangs_after_a_batch(response: str, row: dict) -> float:
  """Varied rewards for the first 8 responses (two batches of the tiny runs), then a call that
  never returns (with reward.num_workers=0 nothing times it out)."""
  _CALLS[0] += 1
  if _CALLS[0] > 8:
    import threading
    threading.Event().wait()
  return float(len(response) % 2)
